"""The base class every config section derives from: strict, documented, validated on assignment."""

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    """A config section: unknown keys are errors; the docstring under each field is its description.

    Numbers must be finite (TOML has `inf` and `nan`): a `rollout.temperature = inf` would parse and
    then have every generate request refused at the engines' edge."""

    model_config = ConfigDict(
        extra="forbid",
        allow_inf_nan=False,
        use_attribute_docstrings=True,
        validate_assignment=True,
        validate_default=True,
    )

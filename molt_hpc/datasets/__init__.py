"""The datasets of the stages beyond RL: chat demonstrations for SFT, preference pairs for the reward model.

- `chat_mask`: where the replies are in a chat rendered by the model's own template; token ids and spans;
- `sft`: `SftDataset`, rows `{"messages"}` or `{"prompt", "completion"}` → (token ids, reply spans);
- `prefs`: `PreferenceDataset`, rows `{"prompt"?, "chosen", "rejected", "margin"?}` → two token lists;
- `rows`: reading a JSONL file with bad rows counted or refused, and the length-balanced step order.
"""

from molt_hpc.datasets.chat_mask import Encoded, ReplyMarkers, RowProblem, encode_chat
from molt_hpc.datasets.prefs import Pair, PreferenceDataset
from molt_hpc.datasets.rows import StepOrder
from molt_hpc.datasets.sft import SftDataset, SftSample

__all__ = [
    "Encoded",
    "Pair",
    "PreferenceDataset",
    "ReplyMarkers",
    "RowProblem",
    "SftDataset",
    "SftSample",
    "StepOrder",
    "encode_chat",
]

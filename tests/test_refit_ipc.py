"""Refit over shared memory between real processes: two engine processes on this host, a sender here.

On the CPU the shared slots are /dev/shm files; on a GPU (`test_onegpu_gpu.py`) they are CUDA IPC
handles, through the same protocol and code. The slots are shared at the first push, sized by its
largest bucket (here an MLP weight of 1.2 MB, larger than the 1 MiB bucket size), and kept. After
every push each engine's logits equal the sender's exactly.
"""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from molt_hpc.config.infra import RefitConfig
from molt_hpc.config.model import TinyModelConfig
from molt_hpc.models import build_tiny, load_causal_lm
from molt_hpc.refit import RefitSender
from molt_hpc.refit.calls import EngineCalls
from molt_hpc.refit.handles import SHM_DIR, choose_transports
from tests.test_engine_pool import _all_logprobs, max_diff, perturbed, sender_logprobs
from tests.test_engine_procs import arun, make_run, start_engines

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="needs /dev/shm")
AUTO = RefitConfig(bucket_mb=1, host="127.0.0.1")


def record_refit_files(monkeypatch) -> list[Path]:
    """The /dev/shm files the refit creates from now on (its own, whatever other runs on this host do)."""
    import molt_hpc.refit.ipc as ipc

    created: list[Path] = []
    real = ipc.shm_file

    def recording(nbytes: int) -> Path:
        created.append(real(nbytes))
        return created[-1]

    monkeypatch.setattr(ipc, "shm_file", recording)
    return created


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    root = tmp_path_factory.mktemp("ipc")
    model_dir = build_tiny(root / "model", TinyModelConfig(intermediate_size=2304))
    run = make_run(root, "ipc", model_dir)
    engines = start_engines(run, [0, 1])
    yield run, model_dir, engines
    for p in engines:
        p.stop()


def record_calls(monkeypatch) -> list[str]:
    """The paths of the HTTP calls senders make to engines from now on (each call still goes through)."""
    paths: list[str] = []
    real = EngineCalls._post_now

    def recording(self, url: str, path: str, body: dict):
        paths.append(path)
        return real(self, url, path, body)

    monkeypatch.setattr(EngineCalls, "_post_now", recording)
    return paths


def exact(engines, token: str, model, version: int) -> None:
    want = sender_logprobs(model)
    for logprobs, served in arun(_all_logprobs(engines, token)):
        assert served == version and max_diff(logprobs, want) == 0


def test_engines_on_this_host_take_the_weights_from_shared_slots(shared, monkeypatch) -> None:
    run, model_dir, engines = shared
    urls, token = [p.url for p in engines], run.token()
    created = record_refit_files(monkeypatch)
    sender = RefitSender(run.path, AUTO, token)
    sender.connect(urls)
    assert sender.transports == dict.fromkeys(urls, "ipc")
    assert not (run.rendezvous / "refit_store.json").exists(), "no broadcast group, no TCPStore"

    old, new, newer = load_causal_lm(model_dir), perturbed(model_dir, seed=1), perturbed(model_dir, seed=2)
    calls = record_calls(monkeypatch)
    stats = sender.push(new.named_parameters(), version=5)
    # every engine behind shared memory: one call each pauses it, loads and resumes it (after sharing the slots)
    assert calls == ["/init_weight_transfer_engine"] * 2 + ["/update_weights"] * 2, calls
    assert stats.buckets >= 7 and stats.engines == 2
    assert len(created) == 3 and not any(p.exists() for p in created), "unlinked once every engine mapped them"
    exact(engines, token, new, 5)
    assert max_diff(sender_logprobs(old), sender_logprobs(new)) > 1e-3, "the push must change the outputs"
    sender.push(newer.named_parameters(), version=6, in_place=True)  # host tensors: still through the slots
    exact(engines, token, newer, 6)
    for p in engines:  # shared once, at the first push, by slots the size of its largest bucket
        log = p.log.read_text()
        assert log.count("mapped the trainer's 2 refit slots") == 1 and "slots of 1 MiB (shared memory" in log

    with pytest.raises(RuntimeError, match="does not have"):  # refused before any bucket is taken
        sender.push([("model.not_a_layer.weight", torch.zeros(3))], version=7)
    with pytest.raises(ValueError, match="connect"):
        sender.push(old.named_parameters(), version=7)  # a failed push drops the slots
    sender.connect(urls)
    sender.push(old.named_parameters(), version=7)
    exact(engines, token, old, 7)
    sender.close()
    assert len(created) > 3 and not any(p.exists() for p in created), "each new channel's files unlinked too"


def test_one_push_reaches_shared_memory_engines_and_a_group_together(shared, monkeypatch) -> None:
    """An engine that does not say where it runs (an older engine) gets the broadcast group; the other
    keeps shared memory. Each bucket is packed once, into a slot, and goes both ways from there."""
    run, model_dir, engines = shared
    urls, token = [p.url for p in engines], run.token()
    real = EngineCalls.places
    monkeypatch.setattr(EngineCalls, "places", lambda self, u: [real(self, u)[0], None])
    sender = RefitSender(run.path, AUTO, token)
    sender.connect(urls)
    assert sender.transports == {urls[0]: "ipc", urls[1]: "gloo"}
    model = perturbed(model_dir, seed=3)
    calls = record_calls(monkeypatch)
    sender.push(model.named_parameters(), version=8)
    exact(engines, token, model, 8)
    # a group engine must be paused before the first bucket is broadcast: start, update and finish apart
    assert calls.count("/start_weight_update") == calls.count("/finish_weight_update") == 2, calls
    sender.close()


def test_transport_choice_refuses_what_cannot_work() -> None:
    gpu = {"host_id": "a", "shm_id": "1:2", "device_uuids": ["GPU-1"]}
    other_gpu = {"host_id": "a", "shm_id": "1:2", "device_uuids": ["GPU-2"]}
    urls = ["http://e0", "http://e1"]
    assert choose_transports("auto", "nccl", gpu, [gpu, other_gpu], urls, 1 << 20) == ["ipc", "nccl"]
    assert choose_transports("auto", "nccl", gpu, [None, other_gpu], urls, 1 << 20) == ["nccl", "nccl"]
    with pytest.raises(ValueError, match=r"NCCL refuses two ranks on one GPU.*refit\.backend = 'auto'"):
        choose_transports("nccl", "nccl", gpu, [gpu, other_gpu], urls, 1 << 20)
    with pytest.raises(ValueError, match="http://e1 is not on this trainer's GPU GPU-1"):
        choose_transports("ipc", "nccl", gpu, [gpu, other_gpu], urls, 1 << 20)
    other_container = {**gpu, "shm_id": "7:2"}  # the trainer's GPU, another /dev/shm
    with pytest.raises(ValueError, match=r"does not share its /dev/shm.*--ipc=host"):
        choose_transports("auto", "nccl", gpu, [other_container, other_gpu], urls, 1 << 20)
    cpu, elsewhere = {"host_id": "a", "shm_id": "1:2", "device_uuids": []}, {"host_id": "b", "device_uuids": []}
    assert choose_transports("auto", "gloo", cpu, [cpu, elsewhere], urls, 1 << 20) == ["ipc", "gloo"]
    assert choose_transports("auto", "gloo", cpu, [cpu, {**cpu, "shm_id": "7:2"}], urls, 1 << 20) == ["ipc", "gloo"]
    assert choose_transports("gloo", "gloo", cpu, [cpu, cpu], urls, 1 << 20) == ["gloo", "gloo"]
    huge = 1 << 50  # more than any /dev/shm: auto falls back to the group, ipc still tries (and says why)
    assert choose_transports("auto", "gloo", cpu, [cpu, cpu], urls, huge) == ["gloo", "gloo"]
    assert choose_transports("ipc", "gloo", cpu, [cpu, cpu], urls, huge) == ["ipc", "ipc"]


def test_handles_from_the_wire_are_checked_before_use(tmp_path) -> None:
    """Init calls carry paths and CUDA IPC handle fields: only our own /dev/shm files are opened, and a
    malformed handle is refused field by field before CUDA sees it."""
    from molt_hpc.refit.handles import open_cuda_handle
    from molt_hpc.refit.ipc import IpcChannel, IpcInbox

    channel = IpcChannel(torch.device("cpu"), 64, consumers=1, timeout_s=5)
    good = channel.init_info(0)
    try:
        for control in ("/etc/passwd", "/dev/shm/../etc/passwd", str(tmp_path / "molt-refit-x"), 7):
            with pytest.raises(ValueError, match=r"not a refit file|must be a string"):
                IpcInbox({**good, "control": control}, timeout_s=5)
        link = SHM_DIR / f"molt-refit-link-{os.getpid()}"
        link.symlink_to(good["control"])
        try:
            with pytest.raises(ValueError, match="not a regular file"):
                IpcInbox({**good, "control": str(link)}, timeout_s=5)
        finally:
            link.unlink()
        with pytest.raises(ValueError, match="not a refit control file"):  # one of ours, but a slot
            IpcInbox({**good, "control": good["slots"][0]["path"]}, timeout_s=5)
        with pytest.raises(ValueError, match="consumer 1 of 1"):
            IpcInbox({**good, "consumer": 1}, timeout_s=5)
        inbox = IpcInbox(good, timeout_s=5)
        channel.buffers[0][:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
        assert inbox.buffers[0][:4].tolist() == [1, 2, 3, 4], "the engine maps the trainer's bytes"
        inbox.close()
    finally:
        channel.close()
    cuda = {"kind": "cuda", "nbytes": 64, "offset": 0, "storage": "TypedStorage", "handle": "AAAA",
            "storage_bytes": 64, "storage_offset": 0, "ref_counter": "AAAA", "ref_counter_offset": 0,
            "event": None, "event_sync": False}  # fmt: skip
    for bad, match in [({"storage": "os.system"}, "storage kind"), ({"offset": -1}, "non-negative"),
                       ({"nbytes": 65}, "does not fit"), ({"handle": "%%%"}, "not base64"),
                       ({"event": "AAAA"}, "expected 64"), ({"event_sync": "yes"}, "event_sync")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            open_cuda_handle({**cuda, **bad}, "GPU-0")


def test_shared_parameter_records_are_checked_before_use() -> None:
    """The in-place refit's init call carries one record per parameter: each field is checked before its
    CUDA IPC handle is opened; host tensors (or non-contiguous ones) are never offered for it."""
    from molt_hpc.refit.shared_params import SharedParams, shareable

    assert not shareable([]) and not shareable([("w", torch.ones(4))]), "host tensors go through the slots"
    cuda = {"kind": "cuda", "nbytes": 64, "offset": 0, "storage": "TypedStorage", "handle": "AAAA",
            "storage_bytes": 64, "storage_offset": 0, "ref_counter": "AAAA", "ref_counter_offset": 0,
            "event": None, "event_sync": False}  # fmt: skip
    good = {"name": "w", "dtype": "float32", "shape": [16], "bytes": cuda}
    for bad, match in [({"name": 3}, "'name'"), ({"dtype": "int64"}, "not a floating"),
                       ({"dtype": "os.system"}, "unknown dtype"), ({"shape": [0]}, "positive"),
                       ({"shape": "16"}, "positive"), ({"bytes": {"kind": "shm"}}, "CUDA IPC"),
                       ({"bytes": {**cuda, "storage": "os.system"}}, "storage kind")]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            SharedParams({"params": [{**good, **bad}], "device_uuid": "GPU-0"})
    with pytest.raises(ValueError, match="non-empty"):
        SharedParams({"params": [], "device_uuid": "GPU-0"})
    with pytest.raises(ValueError, match="device_uuid"):
        SharedParams({"params": [good]})


# A trainer stand-in that refits in a loop over shared memory (safetensors read directly).
SENDER_LOOP = """
import sys
from safetensors.torch import load_file
from molt_hpc.config.infra import RefitConfig
from molt_hpc.refit import RefitSender
run, model_dir, token, *urls = sys.argv[1:]
weights = load_file(model_dir + "/model.safetensors")
sender = RefitSender(run, RefitConfig(bucket_mb=1, host="127.0.0.1"), token)
sender.connect(urls)
assert set(sender.transports.values()) == {"ipc"}, sender.transports
print("pushing", flush=True)
for version in range(100, 100000):
    weights["model.norm.weight"] += 0.01
    sender.push(weights.items(), version)
"""


def test_a_sender_killed_mid_refit_leaves_no_torn_weights(shared) -> None:
    """A killed trainer leaves its engines waiting on slots nobody fills: they notice (its lock on the
    control file is gone) and a new sender's push brings both to exactly its weights."""
    run, model_dir, engines = shared
    urls, token = [p.url for p in engines], run.token()
    cmd = [sys.executable, "-c", SENDER_LOOP, str(run.path), str(model_dir), token, *urls]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.stdout.readline().strip() == "pushing"
    time.sleep(0.5)  # let it get into a push; wherever the kill lands, the next push must be whole
    proc.kill()
    proc.wait()
    newest = perturbed(model_dir, seed=4)
    sender = RefitSender(run.path, AUTO, token)
    sender.connect(urls)
    t0 = time.monotonic()
    sender.push(newest.named_parameters(), version=9)
    assert time.monotonic() - t0 < 30, "the engines did not wait out a timeout for the dead sender"
    exact(engines, token, newest, 9)
    sender.close()

"""The disk tier: experts read from the checkpoint's own safetensors byte ranges (single file,
sharded, per-expert or stacked layouts), greedy tokens identical to ``resident``, clear errors for
a truncated or unreadable file."""

from __future__ import annotations

import shutil
import time
import warnings

import pytest
import torch

import specter
from specter.errors import SpecterError
from specter.memory.blocked_layout import block
from specter.model.layout import moe_layers
from specter.memory.disk import CheckpointIndex, DiskExperts
from specter.testing.zoo import ARCHITECTURES, random_model, save_random_checkpoint

PROMPTS = [[1, 17, 93, 4, 250, 31, 8, 66, 140, 7]]


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    path = tmp_path_factory.mktemp("zoo") / "sharded"
    random_model("mixtral", seed=3, layers=3).save_pretrained(path, max_shard_size="300KB")
    assert (path / "model.safetensors.index.json").is_file() and len(list(path.glob("*.safetensors"))) > 2
    return path


def recipe(path, engine="ondemand", **offload) -> dict:
    return {"model": str(path), "engine": engine, "device": "cpu", "max_new_tokens": 10, "threads": 1,
            "offload": {"expert_budget": 0.25, "experts_on": "disk", **offload},
            "speculation": {"governor": {"k": 3}}}


def tokens(data) -> tuple[list[list[int]], dict]:
    engine = specter.load(data)
    try:
        result = engine.generate(PROMPTS)
    finally:
        engine.close()
    return result.token_ids, result.report


@pytest.mark.parametrize("fixture", ["sharded", "tiny_mixtral"])
def test_every_expert_read_from_disk_equals_the_loaded_one(fixture, request):
    path = request.getfixturevalue(fixture)
    model = specter.load({"model": str(path), "engine": "resident", "device": "cpu"}).model
    layers = moe_layers(model)
    disk = DiskExperts(CheckpointIndex(path), layers, torch.float32, direct=True)
    for info in layers:
        for expert in range(info.num_experts):
            for name, tensor in disk.read(info.layer, expert).items():
                assert torch.equal(tensor, getattr(info.experts, name)[expert])
    blocked = {name: torch.empty(shape) for name, shape in disk.param_shapes.items()}
    disk.read_into(blocked, layers[-1].layer, 5, blocked=True)  # the blocked layout, piece by piece
    for name, tensor in blocked.items():
        assert torch.equal(tensor, block(getattr(layers[-1].experts, name)[5].detach()))
    assert disk.mode in ("O_DIRECT", "buffered + POSIX_FADV_DONTNEED")
    assert disk.bytes_read > 0 and disk.busy_s > 0
    disk.close()


@pytest.mark.parametrize("engine", ["ondemand", "specter"])
@pytest.mark.parametrize("direct_io", [True, False])
def test_greedy_tokens_through_the_disk_tier_equal_resident(sharded, engine, direct_io):
    reference, _ = tokens({"model": str(sharded), "engine": "resident", "device": "cpu", "max_new_tokens": 10})
    got, report = tokens(recipe(sharded, engine, direct_io=direct_io))
    assert got == reference
    link = report["link"]
    assert link["kind"] == "disk" and link["emulated"] is False
    assert link["bytes_read"] > 0 and link["read_gbps"] > 0
    assert link["io"] == ("page cache allowed" if not direct_io else link["io"])


def test_the_bundled_layout_reads_from_disk_too(tiny_mixtral):
    reference, _ = tokens({"model": str(tiny_mixtral), "engine": "resident", "device": "cpu", "max_new_tokens": 10})
    assert tokens(recipe(tiny_mixtral, "specter"))[0] == reference


def test_a_truncated_shard_is_refused_naming_it(sharded, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(sharded, copy)
    shard = sorted(copy.glob("*.safetensors"))[-1]
    shard.write_bytes(shard.read_bytes()[:-1000])
    with pytest.raises(SpecterError, match=f"{shard.name} is truncated or corrupt"):
        specter.load(recipe(copy))


@pytest.mark.parametrize("direct_io", [True, False])
def test_a_short_read_while_decoding_names_the_file_and_tensor(sharded, monkeypatch, direct_io):
    import os

    engine = specter.load(recipe(sharded, expert_budget={"experts": 2}, direct_io=direct_io))
    real_preadv = os.preadv  # both read modes read through preadv
    monkeypatch.setattr(os, "preadv", lambda fd, buffers, offset: min(real_preadv(fd, buffers, offset), 100))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(SpecterError, match=r"disk tier: short read of tensor '.*experts.*' from .*\.safetensors"):
            engine.generate(PROMPTS)
    # the reload from the checkpoint failed the same way: no warning claims it was reloaded
    assert not [w for w in caught if "reloaded it directly" in str(w.message)]
    monkeypatch.undo()
    engine.close()


def test_the_disk_link_needs_the_disk_tier_and_a_cpu(sharded):
    with pytest.raises(SpecterError, match="offload.link.kind: the disk link reads experts from the checkpoint"):
        specter.load(recipe(sharded, experts_on="host", link={"kind": "disk"}))
    with pytest.raises(SpecterError, match=r"offload.link.kind: 'emulated' copies from host memory, but "
                                           r"offload.experts_on is disk with no host tier: use disk or auto"):
        specter.load(recipe(sharded, experts_on="disk", link={"kind": "emulated"}))


LOAD_PEAK_SCRIPT = """
import json, sys, torch
import specter
import transformers.models.mixtral.modeling_mixtral  # imported before the baseline: not the load's memory


def peak_kib():  # this process's own high-water mark (ru_maxrss would carry the parent's over exec)
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))


torch.set_num_threads(1)
before = peak_kib()
engine = specter.load(json.loads(sys.argv[1]))
after = peak_kib()
tokens = engine.generate([[1, 17, 93, 4, 250, 31]]).token_ids
print(json.dumps({"peak_growth_kib": after - before, "tokens": tokens}))
"""


def test_loading_for_the_disk_tier_never_holds_the_experts(tmp_path):
    """A model whose experts (192 MiB in bf16, 8 layers) dwarf its dense weights loads for the disk
    tier with the process's peak memory growing by well under the checkpoint's size (a whole load
    in fp32 grows it by over twice the checkpoint): the experts are read from the checkpoint on demand,
    never loaded whole (only the first MoE layer is loaded once, to check the disk tier's reading
    of it: its mapped pages and a copy, about a quarter of the checkpoint here)."""
    import json
    import subprocess
    import sys

    path = tmp_path / "wide"
    # saved in bf16 and run in fp32: a load converts, so it cannot hand out views of the mapped file
    random_model("mixtral", seed=5, layers=8, intermediate=4096).to(torch.bfloat16).save_pretrained(path)
    checkpoint_bytes = sum(file.stat().st_size for file in path.glob("*.safetensors"))

    def run(data: dict) -> dict:
        done = subprocess.run([sys.executable, "-c", LOAD_PEAK_SCRIPT, json.dumps(data)], capture_output=True,
                              text=True, timeout=300, check=True)
        return json.loads(done.stdout.strip().splitlines()[-1])

    base = {"model": str(path), "device": "cpu", "dtype": "float32", "max_new_tokens": 6, "threads": 1, "check_lossless": False}
    disk = run({**base, "engine": "ondemand", "offload": {"expert_budget": {"experts": 2}, "experts_on": "disk"}})
    resident = run({**base, "engine": "resident"})
    assert disk["tokens"] == resident["tokens"]
    assert resident["peak_growth_kib"] * 1024 > 2 * checkpoint_bytes  # the measure sees a whole load
    assert disk["peak_growth_kib"] * 1024 < 0.6 * checkpoint_bytes
    assert disk["peak_growth_kib"] < 0.15 * resident["peak_growth_kib"]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_every_layout_decodes_from_disk_as_resident_does(arch, tmp_path):
    path = save_random_checkpoint(arch, tmp_path / arch, seed=0)
    reference, _ = tokens({"model": str(path), "engine": "resident", "device": "cpu", "max_new_tokens": 10})
    engine = specter.load(recipe(path, expert_budget=0.5))
    try:
        assert all(getattr(info.experts, name).numel() == 0 for info in engine.layers for name in info.param_names)
        assert engine.generate(PROMPTS).token_ids == reference
    finally:
        engine.close()


def open_files_under(directory) -> list[str]:
    """The files under ``directory`` this process holds open."""
    import os

    root, found = str(directory.resolve()), []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(root + "/"):
            found.append(target)
    return found


@pytest.mark.parametrize("tiered", [False, True])
@pytest.mark.parametrize("verify_copies", [False, True])
def test_the_link_figures_count_only_the_links_reads_not_the_drafts(sharded, monkeypatch, tiered, verify_copies):
    """``specter`` quantises its draft from every expert read off the disk at load, and
    ``verify_copies`` reads each expert it checks once more for its checksum; the report's disk
    figures of the first run counted those reads as the link's (a 3-layer model: 48 experts more
    than the cache ever loaded)."""
    monkeypatch.delenv("SPECTER_VERIFY_COPIES", raising=False)
    tier = {"host_budget": 0.5, "link": {"kind": "local"}} if tiered else {}
    engine = specter.load(recipe(sharded, "specter", verify_copies=verify_copies, **tier))
    try:
        report = engine.generate(PROMPTS).report
        per_expert = engine.store.disk.expert_file_bytes(engine.layers[0].layer, 0)
        assert per_expert == engine.store.expert_bytes  # a float32 checkpoint run in float32
        loads = report["bytes_transferred"] // engine.store.expert_bytes  # the cache's loads, prefill included
        reads = report["link"]["host_tier"]["disk_reads"] if tiered else loads
        assert report["link"]["bytes_read"] == reads * per_expert
    finally:
        engine.close()


@pytest.mark.parametrize("engine_name", ["ondemand", "specter"])
def test_an_engine_closed_before_it_generates_leaves_no_checkpoint_file_open(sharded, engine_name):
    before = open_files_under(sharded)
    for _ in range(2):
        engine = specter.load(recipe(sharded, engine_name))
        engine.close()
    assert open_files_under(sharded) == before


def test_a_detached_reader_reads_the_same_bytes_and_counts_on_its_own(tiny_mixtral):
    model = specter.load({"model": str(tiny_mixtral), "engine": "resident", "device": "cpu"}).model
    disk = DiskExperts(CheckpointIndex(tiny_mixtral), moe_layers(model), torch.float32)
    before = open_files_under(tiny_mixtral)
    with disk.detached() as reader:
        got = reader.read(0, 3)
        assert reader.bytes_read == disk.expert_file_bytes(0, 3) and len(open_files_under(tiny_mixtral)) > len(before)
    assert disk.bytes_read == 0 and open_files_under(tiny_mixtral) == before
    for name, tensor in disk.read(0, 3).items():
        assert torch.equal(tensor, got[name])
    assert disk.bytes_read == disk.expert_file_bytes(0, 3)
    disk.close()
    assert open_files_under(tiny_mixtral) == before


def test_a_shard_the_index_names_but_the_directory_lacks_is_named_before_loading(sharded, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(sharded, copy)
    shard = sorted(copy.glob("*.safetensors"))[1]
    shard.unlink()
    for engine in ("ondemand", "resident", "hf-offload"):
        with pytest.raises(SpecterError, match=rf"^model: shard {shard.name} named by .*index.json is missing"):
            specter.load(recipe(copy, engine))


def test_an_unreadable_checkpoint_file_is_not_called_corrupt(sharded, monkeypatch):
    """As root ``chmod`` does not stop a read, so the refusal is simulated where the header is read."""
    from pathlib import Path

    shard = sorted(sharded.glob("*.safetensors"))[0]
    real_open = Path.open

    def refusing(self, *args, **kwargs):
        if self == shard:
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *args, **kwargs)

    monkeypatch.setattr(Path, "open", refusing)
    with pytest.raises(SpecterError, match=rf"^model: {shard} cannot be read by this process \(permission denied\)"):
        specter.load(recipe(sharded))


def test_a_pickle_checkpoint_is_refused_for_the_disk_tier_saying_why(tmp_path):
    """``allow_pickle: true`` lets a ``.bin`` checkpoint load, but the disk tier reads safetensors
    byte ranges: a one-line refusal naming ``offload.experts_on``, not transformers' OSError."""
    model = random_model("mixtral", seed=3, layers=2)
    model.config.save_pretrained(tmp_path)
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(SpecterError, match=r"^offload\.experts_on: disk reads the experts from the checkpoint's "
                                           r"safetensors files, but .* holds only pickle"):
        specter.load({**recipe(tmp_path), "allow_pickle": True})


def test_concurrent_reads_on_a_filesystem_that_refuses_o_direct_all_fall_back(tiny_mixtral, monkeypatch):
    """Where ``O_DIRECT`` is refused (EINVAL), the disk link's workers meet the refusal together;
    the first to see it switched the reader to buffered reads, and a read whose direct attempt
    failed after that switch was reported as a failed read (``SpecterError``) instead of retried."""
    import concurrent.futures
    import errno
    import os
    import threading

    if not hasattr(os, "O_DIRECT"):
        pytest.skip("no O_DIRECT on this platform")
    model = specter.load({"model": str(tiny_mixtral), "engine": "resident", "device": "cpu"}).model
    disk = DiskExperts(CheckpointIndex(tiny_mixtral), moe_layers(model), torch.float32, direct=True)
    real_open, real_direct = os.open, DiskExperts._read_direct
    together = threading.Barrier(2)

    def refusing_direct(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", str(path))
        return real_open(path, flags, *args, **kwargs)

    def direct_attempt(self, file, start, end):
        together.wait(timeout=10)  # both reads chose O_DIRECT before either met the refusal
        return real_direct(self, file, start, end)

    monkeypatch.setattr(os, "open", refusing_direct)
    monkeypatch.setattr(DiskExperts, "_read_direct", direct_attempt)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda expert: disk.read(0, expert), [0, 1]))
    monkeypatch.undo()
    assert disk.mode == "buffered + POSIX_FADV_DONTNEED"
    for expert, got in enumerate(results):
        for name, tensor in got.items():
            assert torch.equal(tensor, getattr(moe_layers(model)[0].experts, name)[expert])
    disk.close()


def test_a_read_that_fails_with_a_timeout_error_is_that_error_not_a_stalled_link() -> None:
    """Python's futures time out with the builtin TimeoutError, which a failed read (an OS timeout)
    raises too: a finished read's error is raised as it is, with or without a deadline."""
    import concurrent.futures

    from specter.memory.disk_store import FutureTransfer

    def read() -> None:
        time.sleep(0.05)
        raise TimeoutError("[Errno 110] Connection timed out")

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        for timeout in (5.0, None):
            transfer = FutureTransfer(pool.submit(read), 8)
            started = time.perf_counter()
            with pytest.raises(TimeoutError, match="Connection timed out"):
                transfer.wait(timeout)
            assert time.perf_counter() - started < 2.0


def test_mapping_a_large_per_expert_checkpoint_takes_a_moment_not_minutes() -> None:
    """Qwen3-30B-A3B's index (48 layers x 128 experts stored per expert: 18,864 tensors): a layer
    mapped in well under a second (each expert's names used to be searched for among every
    tensor name, 10-15 s a layer, 8-12 minutes an engine build)."""
    import types
    from pathlib import Path as P

    from specter.memory.disk import TensorRange

    layers, experts = 48, 128
    names = sorted([f"model.layers.{layer}.self_attn.q_proj.weight" for layer in range(layers)]
                   + [f"model.layers.{layer}.mlp.experts.{e}.{part}.weight" for layer in range(layers)
                      for e in range(experts) for part in ("gate_proj", "up_proj", "down_proj")])
    index = types.SimpleNamespace(names=lambda: list(names), tensors={
        n: TensorRange(n, P("/x"), torch.bfloat16, (768, 2048), 0, 768 * 2048 * 2) for n in names})
    disk = DiskExperts.__new__(DiskExperts)
    disk.index = index
    info = types.SimpleNamespace(layer=47, param_names=("gate_up_proj", "down_proj"), num_experts=experts,
                                 experts=types.SimpleNamespace(is_transposed=False))
    started = time.perf_counter()
    pieces = disk._map_layer(info)
    assert time.perf_counter() - started < 2.0
    assert len(pieces) == experts and pieces[5][2].source.name == "model.layers.47.mlp.experts.5.down_proj.weight"


def test_a_closed_disk_link_refuses_every_submit() -> None:
    """After ``close()`` (its pool shut down), a submit of a disk expert or of host tensors is
    refused naming the link, as a closed copy-thread link refuses."""
    from specter.memory.disk_store import DiskLink

    link = DiskLink(workers=1)
    link.close()
    with pytest.raises(SpecterError, match="submit on a closed disk link"):
        link.submit({"w": torch.zeros(4)}, {"w": torch.ones(4)}, 0)

"""GPU timings for scripts/device_check.sh: pinned host-to-device bandwidth, then ``resident`` vs
``ondemand`` decode on a Mixtral-shaped random-weight model whose experts dominate (``resident``
also with each of transformers' experts implementations: the choice moved it 1.7x on an H200).

Contract: ``python scripts/gpu_bench.py [--layers 8 --experts 8 --budget 0.25 --tokens 32] [--json PATH]``
needs a CUDA device (without one it exits 1 at once, saying so); prints a table and writes JSON to
``--json`` PATH, else to ``$OUT/gpu_bench.json`` when ``OUT`` is set. One model is built on the GPU (bf16), timed resident, then offloaded in place with
``specter.offload`` (experts to pinned host memory, a device cache of ``--budget`` of them, the
``cuda`` link) and timed again with the same prompt; greedy tokens are compared.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

IMPLEMENTATIONS = ("eager", "batched_mm", "grouped_mm")  # one-token steps on an H200 ran 69.9 / 104.0 / 62.6 tok/s


def pinned_bandwidth(gib: float = 1.0, repeats: int = 10) -> float:
    host = torch.empty(int(gib * 2**30), dtype=torch.uint8).pin_memory()
    device = torch.empty_like(host, device="cuda")
    device.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(repeats):
        device.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    return gib * 2**30 * repeats / (time.perf_counter() - started) / 1e9


@torch.inference_mode()
def time_decode(model, prompt: torch.Tensor, tokens: int) -> tuple[float, list[int]]:
    from specter.decode.kv import forward_logits, new_kv_cache

    kv = new_kv_cache(model)
    logits = forward_logits(model, prompt, kv)
    token = int(logits[-1].argmax())
    out = [token]
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(tokens - 1):
        logits = forward_logits(model, torch.tensor([[token]], device="cuda"), kv)
        token = int(logits[-1].argmax())
        out.append(token)
    torch.cuda.synchronize()
    return (tokens - 1) / (time.perf_counter() - started), out


def warm_up(model, prompt: torch.Tensor, seconds: float = 2.0) -> None:
    """Decode until ``seconds`` have passed: on an H200 the first seconds of a run were about 3x
    slower than later ones in the same process (grouped_mm 20.1 tok/s first, 62.6 later)."""
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        time_decode(model, prompt, 8)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--budget", type=float, default=0.25)
    parser.add_argument("--tokens", type=int, default=32, help="decoded tokens timed (at least 2)")
    parser.add_argument("--json", help="where to write the figures (default: $OUT/gpu_bench.json when OUT is set)")
    args = parser.parse_args(argv)
    if args.layers < 1 or args.experts < 2:
        parser.error("--layers must be at least 1 and --experts at least 2")
    if not 0 < args.budget <= 1:
        parser.error(f"--budget must be a fraction in (0, 1], got {args.budget}")
    if args.tokens < 2:
        parser.error(f"--tokens must be at least 2 (the first comes from the prompt), got {args.tokens}")
    if not torch.cuda.is_available():
        print("gpu_bench.py: needs a CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 1
    import specter
    from specter.testing.zoo import mixtral_shaped, random_model

    results: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    results["pinned_h2d_gbps"] = pinned_bandwidth()
    config = mixtral_shaped(layers=args.layers, experts=args.experts)
    started = time.perf_counter()
    model = random_model(config, device="cuda")
    results["build_s"] = time.perf_counter() - started
    prompt = torch.randint(0, config.vocab_size, (1, 32), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    default = model.config._experts_implementation_internal
    for implementation in IMPLEMENTATIONS:  # transformers' experts kernels for the resident model
        model.set_experts_implementation(implementation)
        warm_up(model, prompt)
        results[f"resident_tok_s_{implementation}"] = time_decode(model, prompt, args.tokens)[0]
    model.set_experts_implementation(default)
    warm_up(model, prompt)
    results["resident_experts_implementation"] = default
    results["resident_tok_s"], resident_tokens = time_decode(model, prompt, args.tokens)
    handle = specter.offload(model, expert_budget=args.budget, link="cuda")
    warm_up(model, prompt)
    handle.cache.stats = type(handle.cache.stats)()
    results["ondemand_tok_s"], ondemand_tokens = time_decode(model, prompt, args.tokens)
    stats = handle.cache.stats
    results.update({
        "budget": args.budget, "slots": handle.cache.capacity, "expert_mib": handle.store.expert_bytes / 2**20,
        "ondemand_hit_rate": stats.hit_rate(), "ondemand_transfer_wait_s": stats.transfer_wait_s,
        "ondemand_gb_moved": stats.bytes_transferred / 1e9, "lossless": resident_tokens == ondemand_tokens,
        "ondemand_vs_resident": results["ondemand_tok_s"] / results["resident_tok_s"],
    })
    width = max(map(len, results))
    for key, value in results.items():
        print(f"{key:<{width}}  {value:.4g}" if isinstance(value, float) else f"{key:<{width}}  {value}")
    path = args.json or (os.path.join(os.environ["OUT"], "gpu_bench.json") if os.environ.get("OUT") else None)
    if path:
        with open(path, "w") as handle_out:
            json.dump(results, handle_out, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

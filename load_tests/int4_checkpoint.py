"""Write an INT4 (W4A16) or INT8 (W8A16, --bits 8) copy of a checkpoint, in compressed-tensors'
pack-quantized format, or a W8A8 INT8 one (--w8a8), to benchmark it beside the original (no
quantized checkpoint reaches these machines).

    python -m load_tests.int4_checkpoint --model llama-8b --group 128 --out /tmp/llama-8b-w4a16
    python -m load_tests.int4_checkpoint --model llama-8b --w8a8 --out /tmp/llama-8b-w8a8

Every decoder projection's weight (a mixture's experts too: transformers 5's stacked
`experts.gate_up_proj` and `experts.down_proj` are written as each expert's gate_proj,
up_proj and down_proj, as quantized checkpoints store them; the router is left out) becomes
`weight_packed` (8 four-bit values an int32, low bits first, offset by 8; or 4 eight-bit
ones offset by 128), `weight_scale` (each group's absolute maximum over 7, or 127, in the
model's dtype) and `weight_shape`, as llm-compressor writes them; everything else is copied.
With --w8a8 each becomes `weight` (int8, one a weight) and `weight_scale` (each row's
absolute maximum over 127), in int-quantized format with dynamic per-token int8 activations,
as llm-compressor's W8A8 scheme writes them (RedHatAI's quantized.w8a8 releases).
The quantization here is this script's own (round to nearest), not the engine's.
"""
from __future__ import annotations

import argparse
import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine_actors.checkpoint import RANDOM_MARKER, iter_checkpoint_tensors, resolve_model_path

# the decoder's projections: attention's, an MLP's, a shared expert's, each expert's (Qwen's
# gate/up/down_proj, Mixtral's w1/w3/w2); never a router or a shared expert's gate
PROJECTION = re.compile(r".*layers\.\d+\.(self_attn|mlp|block_sparse_moe)\."
                        r"(shared_expert\.|experts\.\d+\.)?(\w+_proj|w[123])\.weight$")
STACKED = re.compile(r"(.*layers\.\d+\.mlp\.experts)\.(gate_up_proj|down_proj)$")


def projections(name: str, tensor: torch.Tensor):
    """(name, weight) of each projection in a checkpoint tensor: itself, or each expert's
    of transformers 5's stacked experts ([E, 2I, H] gate's rows then up's; [E, H, I])."""
    stacked = STACKED.fullmatch(name)
    if stacked is None:
        yield name, tensor
        return
    prefix, kind = stacked.groups()
    for e, w in enumerate(tensor):
        if kind == "down_proj":
            yield f"{prefix}.{e}.down_proj.weight", w
        else:
            gate, up = w.chunk(2)
            yield f"{prefix}.{e}.gate_proj.weight", gate
            yield f"{prefix}.{e}.up_proj.weight", up
SHARD_BYTES = 4 * 10**9
IGNORED = ["lm_head", "re:.*mlp.gate$", "re:.*block_sparse_moe.gate$", "re:.*shared_expert_gate$"]
W8A8 = {"quant_method": "compressed-tensors", "format": "int-quantized",
        "quantization_status": "compressed", "ignore": IGNORED,
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                                  "strategy": "token", "dynamic": True},
            "weights": {"num_bits": 8, "type": "int", "symmetric": True,
                        "strategy": "channel", "dynamic": False}}}}


def pack(w: torch.Tensor, group: int, bits: int = 4) -> dict[str, torch.Tensor]:
    n, k = w.shape
    top, per_word = (1 << (bits - 1)) - 1, 32 // bits
    g = w.float().reshape(n, k // group, group)
    scales = (g.abs().amax(-1) / top).to(w.dtype).float()  # (as stored: in w's dtype)
    q = (g / scales[..., None]).round().clamp(-top - 1, top).to(torch.int32)
    q = q.reshape(n, k // per_word, per_word) + top + 1
    words = sum(q[..., i] << (bits * i) for i in range(per_word))  # (bit 31: negative)
    return {"weight_packed": words.to(torch.int32), "weight_scale": scales.to(w.dtype),
            "weight_shape": torch.tensor([n, k])}


def int8_rows(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """(Each scale rounded to the weight's dtype first, as it is stored: the values are
    quantized against the scale the engine reads.)"""
    scales = (w.float().abs().amax(-1, keepdim=True).clamp(min=1e-12) / 127).to(w.dtype)
    q = (w.float() / scales.float()).round().clamp(-128, 127).to(torch.int8)
    return {"weight": q, "weight_scale": scales}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-8b")
    ap.add_argument("--group", type=int, default=128)
    ap.add_argument("--bits", type=int, choices=(4, 8), default=4)
    ap.add_argument("--w8a8", action="store_true", help="int8 weights per channel and "
                    "int8 activations per token (int-quantized), not pack-quantized")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    src, out = Path(resolve_model_path(args.model)), Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():  # config, tokenizer, generation config (not the weights)
        if f.suffix in (".json", ".jinja", ".txt", ".model") and "index" not in f.name:
            shutil.copy(f, out / f.name)
    shard, size, index = {}, 0, {}
    device = "cuda" if torch.cuda.is_available() else "cpu"

    def flush():
        nonlocal shard, size
        name = f"model-{len(set(index.values())) + 1:05d}.safetensors"
        save_file({k: v.cpu().contiguous() for k, v in shard.items()}, str(out / name))
        index.update(dict.fromkeys(shard, name))
        shard, size = {}, 0
    for stored, full in iter_checkpoint_tensors(str(src), device):
        for name, tensor in projections(stored, full):
            parts = {name: tensor}
            if PROJECTION.fullmatch(name):
                stem = name.removesuffix("weight")
                quantized = int8_rows(tensor) if args.w8a8 else \
                    pack(tensor, args.group, args.bits)
                parts = {stem + k: v for k, v in quantized.items()}
            for key, value in parts.items():
                shard[key] = value
                size += value.numel() * value.element_size()
            if size >= SHARD_BYTES:
                flush()
    if shard:
        flush()
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": index}))
    (out / RANDOM_MARKER).unlink(missing_ok=True)  # (the weights are on disk now)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization_config"] = W8A8 if args.w8a8 else {
        "quant_method": "compressed-tensors", "format": "pack-quantized",
        "quantization_status": "compressed",
        "ignore": IGNORED,
        "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None,
                                      "weights": {"num_bits": args.bits, "type": "int",
                                                  "symmetric": True, "strategy": "group",
                                                  "group_size": args.group, "dynamic": False,
                                                  "actorder": None}}}}
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    print(f"wrote {out}: {len(set(index.values()))} shards, {len(index)} tensors")


if __name__ == "__main__":
    main()

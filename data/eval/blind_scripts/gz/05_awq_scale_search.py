"""Activation-aware weight quantization (AWQ-style) for Llama checkpoints.

1. every GPU runs its share of the pile-val calibration sequences and records
   the mean |activation| of each input channel of every linear layer;
2. the statistics are summed over GPUs;
3. the per-channel scales s = x_mean ** alpha are searched per layer group
   (the layers are split over the GPUs), folded into the preceding norm /
   linear, and the weights are fake-quantized to int4 with group size 128.

    torchrun --nproc_per_node=4 05_awq_scale_search.py --model meta-llama/Llama-2-7b-hf
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="meta-llama/Llama-2-7b-hf")
    ap.add_argument("--calib", default="mit-han-lab/pile-val-backup")
    ap.add_argument("--n_samples", type=int, default=256)
    ap.add_argument("--seqlen", type=int, default=512)
    ap.add_argument("--w_bit", type=int, default=4)
    ap.add_argument("--q_group_size", type=int, default=128)
    ap.add_argument("--grid", type=int, default=20)
    ap.add_argument("--out", default="awq/llama-2-7b-w4g128")
    return ap.parse_args()


def pseudo_quantize(w, n_bit, group):
    shape = w.shape
    w = w.reshape(-1, group)
    mx, mn = w.amax(dim=1, keepdim=True), w.amin(dim=1, keepdim=True)
    qmax = 2 ** n_bit - 1
    scale = (mx - mn).clamp(min=1e-5) / qmax
    zero = (-torch.round(mn / scale)).clamp(0, qmax)
    w = (torch.clamp(torch.round(w / scale) + zero, 0, qmax) - zero) * scale
    return w.reshape(shape)


def calib_samples(tok, name, n, seqlen):
    ds = load_dataset(name, split="validation").shuffle(seed=42)
    out, buf = [], []
    for row in ds:
        ids = tok(row["text"].strip()).input_ids
        if not ids or len(ids) > seqlen:
            continue
        buf.extend(ids)
        while len(buf) >= seqlen and len(out) < n:
            out.append(torch.tensor(buf[:seqlen]))
            buf = buf[seqlen:]
        if len(out) >= n:
            break
    return torch.stack(out)


class ChannelStats:
    def __init__(self):
        self.sum = {}
        self.count = {}
        self.handles = []

    def hook(self, name):
        def fn(mod, inp, out):
            x = inp[0].detach().reshape(-1, inp[0].shape[-1])
            s = x.abs().float().sum(0).cpu()
            if name in self.sum:
                self.sum[name] += s
                self.count[name] += x.shape[0]
            else:
                self.sum[name] = s
                self.count[name] = x.shape[0]
        return fn

    def attach(self, model):
        for name, m in model.named_modules():
            if isinstance(m, nn.Linear) and "lm_head" not in name:
                self.handles.append(m.register_forward_hook(self.hook(name)))

    def detach(self):
        for h in self.handles:
            h.remove()
        self.handles = []


def search_scale(linears, x_mean, args):
    """Grid search of alpha for a group of linears that share the same input."""
    weight = torch.cat([l.weight.data.float() for l in linears], dim=0)
    best_err, best_s, best_alpha = float("inf"), None, None
    for i in range(args.grid):
        alpha = i / args.grid
        s = x_mean.pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        wq = pseudo_quantize(weight * s, args.w_bit, args.q_group_size) / s
        err = ((wq - weight) * x_mean).pow(2).sum().item()
        if err < best_err:
            best_err, best_s, best_alpha = err, s, alpha
    return best_s, best_alpha


@torch.no_grad()
def apply_scale(prev, linears, s):
    s = s.to(prev.weight.dtype)
    if isinstance(prev, nn.Linear):
        prev.weight.div_(s.view(-1, 1))
        if prev.bias is not None:
            prev.bias.div_(s)
    else:  # RMSNorm
        prev.weight.div_(s)
    for l in linears:
        l.weight.mul_(s.view(1, -1))


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained(args.model, use_fast=False)
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float16).to(device).eval()
    if rank != 0:
        dist.barrier()
    samples = calib_samples(tok, args.calib, args.n_samples, args.seqlen)
    if rank == 0:
        dist.barrier()
    mine = samples[rank::world]

    stats = ChannelStats()
    stats.attach(model)
    t0 = time.time()
    with torch.no_grad():
        for i in range(0, len(mine), 8):
            model(mine[i:i + 8].to(device))
    stats.detach()

    names = sorted(stats.sum)
    counts = torch.tensor([stats.count[n] for n in names], dtype=torch.float64, device=device)
    dist.all_reduce(counts)
    for n in names:
        dist.all_reduce(stats.sum[n])
    x_mean = {n: (stats.sum[n] / counts[j].item()).to(device) for j, n in enumerate(names)}
    if rank == 0:
        print(f"collected stats for {len(names)} linears in {time.time() - t0:.1f}s", flush=True)

    # ---- per-layer scale search, layers split round-robin over ranks ----
    layers = model.model.layers
    found = {}
    for li in range(rank, len(layers), world):
        blk = layers[li]
        p = f"model.layers.{li}."
        groups = {
            "qkv": ([blk.self_attn.q_proj, blk.self_attn.k_proj, blk.self_attn.v_proj], p + "self_attn.q_proj"),
            "o": ([blk.self_attn.o_proj], p + "self_attn.o_proj"),
            "gate_up": ([blk.mlp.gate_proj, blk.mlp.up_proj], p + "mlp.gate_proj"),
            "down": ([blk.mlp.down_proj], p + "mlp.down_proj"),
        }
        found[li] = {}
        for g, (lins, key) in groups.items():
            s, alpha = search_scale(lins, x_mean[key], args)
            found[li][g] = (s.cpu(), alpha)

    gathered = [None] * world
    dist.all_gather_object(gathered, found)
    all_scales = {}
    for part in gathered:
        all_scales.update(part)

    # ---- fold scales and quantize (same on every rank, rank 0 writes) ----
    alphas = {}
    for li, blk in enumerate(layers):
        sc = all_scales[li]
        apply_scale(blk.input_layernorm, [blk.self_attn.q_proj, blk.self_attn.k_proj, blk.self_attn.v_proj],
                    sc["qkv"][0].to(device))
        apply_scale(blk.self_attn.v_proj, [blk.self_attn.o_proj], sc["o"][0].to(device))
        apply_scale(blk.post_attention_layernorm, [blk.mlp.gate_proj, blk.mlp.up_proj], sc["gate_up"][0].to(device))
        apply_scale(blk.mlp.up_proj, [blk.mlp.down_proj], sc["down"][0].to(device))
        for lin in (blk.self_attn.q_proj, blk.self_attn.k_proj, blk.self_attn.v_proj, blk.self_attn.o_proj,
                    blk.mlp.gate_proj, blk.mlp.up_proj, blk.mlp.down_proj):
            lin.weight.data = pseudo_quantize(lin.weight.data, args.w_bit, args.q_group_size)
        alphas[li] = {g: v[1] for g, v in sc.items()}

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        model.save_pretrained(args.out, safe_serialization=True)
        tok.save_pretrained(args.out)
        with open(os.path.join(args.out, "awq_alphas.json"), "w") as f:
            json.dump({"w_bit": args.w_bit, "q_group_size": args.q_group_size, "alphas": alphas}, f, indent=1)
        print(f"saved to {args.out}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

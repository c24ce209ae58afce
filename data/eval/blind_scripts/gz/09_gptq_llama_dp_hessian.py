"""Data-parallel GPTQ for Llama-family models.

The calibration windows are split across ranks (the split does not need to be
even). For every decoder layer each rank accumulates X^T X of its own windows
for every linear, the sums and sample counts are all-reduced, and the seven
linears of the layer are solved by different ranks and broadcast to the rest,
so all ranks continue with identical quantized weights.

    torchrun --nproc_per_node=8 09_gptq_llama_dp_hessian.py --model meta-llama/Llama-3.2-3B --nsamples 250
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

ORDER = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
         "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="meta-llama/Llama-3.2-3B")
    p.add_argument("--nsamples", type=int, default=250)
    p.add_argument("--seqlen", type=int, default=2048)
    p.add_argument("--bits", type=int, default=4)
    p.add_argument("--group", type=int, default=128)
    p.add_argument("--damp", type=float, default=0.01)
    p.add_argument("--cache", default="cache/calib_wikitext_llama32.pt")
    p.add_argument("--out", default="quant/llama32-3b-gptq-w4g128")
    return p.parse_args()


def build_calibration(tok, nsamples, seqlen, path):
    text = "\n\n".join(load_dataset("wikitext", "wikitext-2-raw-v1", split="train")["text"])
    ids = tok(text, return_tensors="pt").input_ids[0]
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, ids.numel() - seqlen - 1, (nsamples,), generator=g)
    windows = torch.stack([ids[s:s + seqlen] for s in starts.tolist()])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    torch.save(windows, tmp)
    os.replace(tmp, path)


def rtn_params(w, bits):
    maxq = 2 ** bits - 1
    wmin = w.min(dim=1, keepdim=True).values.clamp(max=0)
    wmax = w.max(dim=1, keepdim=True).values.clamp(min=0)
    scale = ((wmax - wmin) / maxq).clamp(min=1e-8)
    zero = torch.round(-wmin / scale)
    return scale, zero, maxq


def gptq_solve(W, H, bits, group, damp, block=128):
    W = W.float().clone()
    cols = W.shape[1]
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    H += damp * torch.mean(torch.diag(H)) * torch.eye(cols, device=H.device)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(H)), upper=True)
    Q = torch.zeros_like(W)
    scales, zeros = [], []
    for i1 in range(0, cols, block):
        i2 = min(i1 + block, cols)
        W1 = W[:, i1:i2].clone()
        Err = torch.zeros_like(W1)
        for i in range(i2 - i1):
            c = i1 + i
            if c % group == 0:
                scale, zero, maxq = rtn_params(W[:, c:c + group], bits)
                scales.append(scale)
                zeros.append(zero)
            w = W1[:, i:i + 1]
            q = (torch.clamp(torch.round(w / scale) + zero, 0, maxq) - zero) * scale
            Q[:, c] = q.flatten()
            err = (w.flatten() - q.flatten()) / Hinv[c, c]
            W1[:, i:] -= err.unsqueeze(1) @ Hinv[c, i1 + i:i2].unsqueeze(0)
            Err[:, i] = err
        W[:, i2:] -= Err @ Hinv[i1:i2, i2:]
    return Q, torch.cat(scales, 1), torch.cat(zeros, 1)


def run_layer(layer, x, kwargs):
    out = layer(x, **kwargs)
    return out[0] if isinstance(out, tuple) else out


class HessianAccumulator:
    def __init__(self, linear, device):
        n = linear.in_features
        self.H = torch.zeros(n, n, device=device, dtype=torch.float64)
        self.rows = 0

    def __call__(self, mod, inp, out):
        x = inp[0].detach().reshape(-1, inp[0].shape[-1]).double()
        self.H += x.t() @ x
        self.rows += x.shape[0]


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained(args.model)
    if rank == 0 and not os.path.exists(args.cache):
        build_calibration(tok, args.nsamples, args.seqlen, args.cache)
    dist.barrier()
    windows = torch.load(args.cache, map_location="cpu")
    mine = windows[rank::world]  # 250 windows over 8 ranks: some ranks get 31, some 32

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float16, low_cpu_mem_usage=True)
    model.config.use_cache = False
    model.eval()
    layers = model.model.layers

    # capture the inputs (and kwargs such as rotary embeddings) of layer 0
    model.model.embed_tokens.to(dev)
    model.model.rotary_emb.to(dev)
    layers[0].to(dev)
    inps, layer_kwargs = [], {}

    class Stop(Exception):
        pass

    def grab(mod, args_, kwargs):
        inps.append(args_[0])
        layer_kwargs.update(kwargs)
        raise Stop

    h = layers[0].register_forward_pre_hook(grab, with_kwargs=True)
    with torch.no_grad():
        for w in mine:
            try:
                model(w.unsqueeze(0).to(dev))
            except Stop:
                pass
    h.remove()
    layers[0].cpu()
    model.model.embed_tokens.cpu()
    torch.cuda.empty_cache()

    quant_meta = {}
    for li, layer in enumerate(layers):
        t0 = time.time()
        layer.to(dev)
        mods = {n: layer.get_submodule(n) for n in ORDER}
        accs = {n: HessianAccumulator(m, dev) for n, m in mods.items()}
        hooks = [mods[n].register_forward_hook(accs[n]) for n in ORDER]
        with torch.no_grad():
            for x in inps:
                run_layer(layer, x, layer_kwargs)
        for hk in hooks:
            hk.remove()

        for j, name in enumerate(ORDER):
            acc = accs[name]
            rows = torch.tensor([acc.rows], device=dev, dtype=torch.float64)
            dist.all_reduce(acc.H)
            dist.all_reduce(rows)
            owner = j % world
            lin = mods[name]
            n_groups = math.ceil(lin.in_features / args.group)
            sz = torch.empty(2, lin.out_features, n_groups, device=dev, dtype=torch.float32)
            if rank == owner:
                H = (2.0 * acc.H / rows).float()
                Q, scales, zeros = gptq_solve(lin.weight.data, H, args.bits, args.group, args.damp)
                lin.weight.data.copy_(Q.to(lin.weight.dtype))
                sz[0].copy_(scales)
                sz[1].copy_(zeros)
            # every rank takes part in both broadcasts, whoever owns the linear
            dist.broadcast(lin.weight.data, src=owner)
            dist.broadcast(sz, src=owner)
            quant_meta[f"model.layers.{li}.{name}"] = sz.cpu()
            del acc.H

        with torch.no_grad():
            inps = [run_layer(layer, x, layer_kwargs) for x in inps]
        layer.cpu()
        del accs
        torch.cuda.empty_cache()
        if rank == 0:
            print(f"layer {li + 1}/{len(layers)}: {time.time() - t0:.1f}s", flush=True)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        model.save_pretrained(args.out, safe_serialization=True)
        tok.save_pretrained(args.out)
        torch.save({"bits": args.bits, "group": args.group, "scales_zeros": quant_meta},
                   os.path.join(args.out, "gptq_meta.pt"))
        print("done", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""GPTQ weight-only quantization with the calibration set spread over GPUs.

Every rank pushes its slice of the calibration sequences through the current
decoder layer, the per-linear Hessians are summed with all_reduce, and the
linears of the layer are quantized round-robin by the ranks and broadcast back.

    torchrun --nproc_per_node=8 02_gptq_calib_layers.py --model facebook/opt-2.7b --wbits 4
"""
import argparse
import math
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from datasets import load_dataset
from transformers import AutoModelForCausalLM, AutoTokenizer

DEV = torch.device("cuda:0")


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="facebook/opt-2.7b")
    ap.add_argument("--nsamples", type=int, default=128)
    ap.add_argument("--seqlen", type=int, default=2048)
    ap.add_argument("--wbits", type=int, default=4)
    ap.add_argument("--groupsize", type=int, default=128)
    ap.add_argument("--percdamp", type=float, default=0.01)
    ap.add_argument("--act_order", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save", default="opt-2.7b-w4g128.pt")
    return ap.parse_args()


def quantize(x, scale, zero, maxq):
    q = torch.clamp(torch.round(x / scale) + zero, 0, maxq)
    return scale * (q - zero)


class Quantizer:
    def __init__(self, bits):
        self.maxq = 2 ** bits - 1

    def find_params(self, w):
        xmin = torch.minimum(w.min(1).values, torch.zeros(w.shape[0], device=w.device))
        xmax = torch.maximum(w.max(1).values, torch.zeros(w.shape[0], device=w.device))
        tmp = (xmin == 0) & (xmax == 0)
        xmin[tmp], xmax[tmp] = -1, +1
        self.scale = ((xmax - xmin) / self.maxq).unsqueeze(1)
        self.zero = torch.round(-xmin / self.scale.squeeze(1)).unsqueeze(1)


class GPTQ:
    def __init__(self, layer):
        self.layer = layer
        self.columns = layer.weight.shape[1]
        self.H = torch.zeros((self.columns, self.columns), device=DEV)
        self.nsamples = 0

    def add_batch(self, inp):
        if inp.dim() == 2:
            inp = inp.unsqueeze(0)
        tmp = inp.shape[0]
        inp = inp.reshape(-1, inp.shape[-1]).t()
        self.H *= self.nsamples / (self.nsamples + tmp)
        self.nsamples += tmp
        inp = math.sqrt(2 / self.nsamples) * inp.float()
        self.H += inp.matmul(inp.t())

    def fasterquant(self, wbits, groupsize, percdamp, act_order, blocksize=128):
        W = self.layer.weight.data.clone().float()
        H = self.H
        quantizer = Quantizer(wbits)
        if groupsize == -1:
            quantizer.find_params(W)
        dead = torch.diag(H) == 0
        H[dead, dead] = 1
        W[:, dead] = 0
        if act_order:
            perm = torch.argsort(torch.diag(H), descending=True)
            W, H = W[:, perm], H[perm][:, perm]
        damp = percdamp * torch.mean(torch.diag(H))
        H += damp * torch.eye(self.columns, device=DEV)
        H = torch.linalg.cholesky(H)
        H = torch.cholesky_inverse(H)
        Hinv = torch.linalg.cholesky(H, upper=True)
        Q = torch.zeros_like(W)
        for i1 in range(0, self.columns, blocksize):
            i2 = min(i1 + blocksize, self.columns)
            W1, Q1 = W[:, i1:i2].clone(), torch.zeros_like(W[:, i1:i2])
            Err1, Hinv1 = torch.zeros_like(W1), Hinv[i1:i2, i1:i2]
            for i in range(i2 - i1):
                w, d = W1[:, i], Hinv1[i, i]
                if groupsize != -1 and (i1 + i) % groupsize == 0:
                    quantizer.find_params(W[:, i1 + i:i1 + i + groupsize])
                q = quantize(w.unsqueeze(1), quantizer.scale, quantizer.zero, quantizer.maxq).flatten()
                Q1[:, i] = q
                err = (w - q) / d
                W1[:, i:] -= err.unsqueeze(1).matmul(Hinv1[i, i:].unsqueeze(0))
                Err1[:, i] = err
            Q[:, i1:i2] = Q1
            W[:, i2:] -= Err1.matmul(Hinv[i1:i2, i2:])
        if act_order:
            Q = Q[:, torch.argsort(perm)]
        self.layer.weight.data = Q.to(self.layer.weight.dtype)
        del self.H


def get_c4(tokenizer, nsamples, seqlen, seed):
    data = load_dataset("allenai/c4", data_files={"train": "en/c4-train.00000-of-01024.json.gz"}, split="train")
    rng = random.Random(seed)
    samples = []
    while len(samples) < nsamples:
        doc = data[rng.randint(0, len(data) - 1)]["text"]
        ids = tokenizer(doc, return_tensors="pt").input_ids
        if ids.shape[1] <= seqlen:
            continue
        start = rng.randint(0, ids.shape[1] - seqlen - 1)
        samples.append(ids[:, start:start + seqlen])
    return samples


def find_linears(module):
    return {n: m for n, m in module.named_modules() if isinstance(m, nn.Linear)}


@torch.no_grad()
def capture_layer0_inputs(model, samples):
    layers = model.model.decoder.layers
    dec = model.model.decoder
    dec.embed_tokens.to(DEV)
    dec.embed_positions.to(DEV)
    if dec.final_layer_norm is not None:
        dec.final_layer_norm.to(DEV)
    layers[0].to(DEV)
    cache = {"inps": [], "mask": None}

    class Catcher(nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x, **kw):
            cache["inps"].append(x)
            cache["mask"] = kw["attention_mask"]
            raise ValueError

    layers[0] = Catcher(layers[0])
    for s in samples:
        try:
            model(s.to(DEV))
        except ValueError:
            pass
    layers[0] = layers[0].m
    layers[0].cpu()
    dec.embed_tokens.cpu()
    dec.embed_positions.cpu()
    if dec.final_layer_norm is not None:
        dec.final_layer_norm.cpu()
    torch.cuda.empty_cache()
    return cache["inps"], cache["mask"]


@torch.no_grad()
def quantize_model(model, samples, args, rank, world):
    inps, mask = capture_layer0_inputs(model, samples)
    layers = model.model.decoder.layers
    for li, layer in enumerate(layers):
        t0 = time.time()
        layer.to(DEV)
        subset = find_linears(layer)
        names = sorted(subset)
        gptq = {n: GPTQ(subset[n]) for n in names}
        handles = [subset[n].register_forward_hook(
            lambda m, i, o, n=n: gptq[n].add_batch(i[0].data)) for n in names]
        for x in inps:
            layer(x, attention_mask=mask)
        for h in handles:
            h.remove()

        for j, n in enumerate(names):
            # the Hessians are running means over each rank's samples
            gptq[n].H *= gptq[n].nsamples
            dist.all_reduce(gptq[n].H)
            cnt = torch.tensor([gptq[n].nsamples], device=DEV, dtype=torch.float32)
            dist.all_reduce(cnt)
            gptq[n].H /= cnt
            owner = j % world
            if owner == rank:
                gptq[n].fasterquant(args.wbits, args.groupsize, args.percdamp, args.act_order)
            w = subset[n].weight.data
            dist.broadcast(w, src=owner)

        inps = [layer(x, attention_mask=mask)[0] for x in inps]
        layer.cpu()
        del gptq
        torch.cuda.empty_cache()
        if rank == 0:
            print(f"layer {li:2d}/{len(layers)} done in {time.time() - t0:.1f}s", flush=True)


@torch.no_grad()
def wikitext_ppl(model, tokenizer, seqlen, rank, world):
    test = load_dataset("wikitext", "wikitext-2-raw-v1", split="test")
    enc = tokenizer("\n\n".join(test["text"]), return_tensors="pt").input_ids
    nwin = enc.shape[1] // seqlen
    model.to(DEV)
    nll = torch.zeros(2, device=DEV, dtype=torch.float64)
    for i in range(rank, nwin, world):
        ids = enc[:, i * seqlen:(i + 1) * seqlen].to(DEV)
        loss = model(ids, labels=ids).loss
        nll[0] += loss.double() * (seqlen - 1)
        nll[1] += seqlen - 1
    dist.all_reduce(nll)
    model.cpu()
    return math.exp((nll[0] / nll[1]).item())


def main():
    args = get_args()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()

    tokenizer = AutoTokenizer.from_pretrained(args.model, use_fast=False)
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float16)
    model.config.use_cache = False
    model.eval()

    # rank 0 downloads / prepares the datasets first, the others then read the HF cache
    if rank != 0:
        dist.barrier()
    samples = get_c4(tokenizer, args.nsamples, args.seqlen, args.seed)
    load_dataset("wikitext", "wikitext-2-raw-v1", split="test")
    if rank == 0:
        dist.barrier()
    mine = samples[rank::world]
    if rank == 0:
        print(f"{len(samples)} calibration sequences, {len(mine)} per rank", flush=True)

    t0 = time.time()
    quantize_model(model, mine, args, rank, world)
    if rank == 0:
        print(f"quantization took {time.time() - t0:.0f}s", flush=True)

    ppl = wikitext_ppl(model, tokenizer, args.seqlen, rank, world)
    if rank == 0:
        print(f"wikitext2 ppl after W{args.wbits}g{args.groupsize}: {ppl:.3f}", flush=True)
        torch.save(model.state_dict(), args.save)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Width pruning of the MLP blocks of a Llama model + DDP recovery fine-tune.

Neuron importance is the Wanda-style structured score
    score_j = ||X_j||_2 * ||W_down[:, j]||_2
collected on calibration text. Neurons are ranked globally over all layers, so
layers that matter more keep more of their width. Each layer keeps a multiple
of 64 neurons so the pruned matmuls stay tensor-core friendly.

torchrun --nproc_per_node=8 10_structured_prune_ffn.py --sparsity 0.4
"""
import argparse
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, get_linear_schedule_with_warmup


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="meta-llama/Llama-3.2-3B")
    p.add_argument("--sparsity", type=float, default=0.4, help="fraction of MLP neurons to remove")
    p.add_argument("--multiple_of", type=int, default=64)
    p.add_argument("--min_keep", type=float, default=0.2)
    p.add_argument("--calib_batches", type=int, default=32)
    p.add_argument("--max_len", type=int, default=1024)
    p.add_argument("--bs", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--save_dir", default="ckpt/llama32-3b-ffn40")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def make_dataset(tok, max_len):
    ds = load_dataset("HuggingFaceFW/fineweb-edu", name="sample-10BT", split="train[:200000]")
    ds = ds.map(lambda b: tok(b["text"], truncation=True, max_length=max_len),
                batched=True, remove_columns=ds.column_names, num_proc=16)
    return ds.filter(lambda x: len(x["input_ids"]) >= 128, num_proc=16)


@torch.no_grad()
def neuron_scores(model, loader, n_batches, device):
    layers = model.model.layers
    sq = [torch.zeros(l.mlp.down_proj.in_features, device=device, dtype=torch.float64) for l in layers]
    handles = []
    for i, l in enumerate(layers):
        def hook(mod, inp, out, i=i):
            x = inp[0].reshape(-1, inp[0].shape[-1]).double()
            sq[i] += (x * x).sum(0)
        handles.append(l.mlp.down_proj.register_forward_hook(hook))
    model.eval()
    for k, batch in enumerate(loader):
        if k >= n_batches:
            break
        model(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device))
    for h in handles:
        h.remove()
    scores = []
    for i, l in enumerate(layers):
        col_norm = l.mlp.down_proj.weight.double().norm(dim=0)
        scores.append(sq[i].sqrt() * col_norm)
    return scores


def choose_widths(scores, sparsity, multiple_of, min_keep):
    flat = torch.cat(scores)
    k = int(sparsity * flat.numel())
    thresh = flat.kthvalue(k).values
    keep = []
    for s in scores:
        n = int((s > thresh).sum())
        lo = int(math.ceil(min_keep * s.numel() / multiple_of) * multiple_of)
        n = max(lo, int(round(n / multiple_of)) * multiple_of)
        keep.append(torch.topk(s, n).indices.sort().values)
    return keep


@torch.no_grad()
def shrink_mlp(mlp, idx):
    def sub(lin, rows=None, cols=None):
        w = lin.weight.data
        w = w[rows] if rows is not None else w[:, cols]
        new = nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype, device=w.device)
        new.weight.copy_(w)
        return new
    mlp.gate_proj = sub(mlp.gate_proj, rows=idx)
    mlp.up_proj = sub(mlp.up_proj, rows=idx)
    mlp.down_proj = sub(mlp.down_proj, cols=idx)
    mlp.intermediate_size = idx.numel()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.pad_token = tok.eos_token
    if rank != 0:
        dist.barrier()
    ds = make_dataset(tok, args.max_len)
    if rank == 0:
        dist.barrier()
    collator = DataCollatorForLanguageModeling(tok, mlm=False)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16).to(device)

    # ---------------- pruning ----------------
    t0 = time.time()
    calib_sampler = DistributedSampler(ds, shuffle=True, seed=args.seed)
    calib_loader = DataLoader(ds, batch_size=args.bs, sampler=calib_sampler, collate_fn=collator)
    scores = neuron_scores(model, calib_loader, args.calib_batches, device)
    keep = choose_widths(scores, args.sparsity, args.multiple_of, args.min_keep)
    for layer, idx in zip(model.model.layers, keep):
        shrink_mlp(layer.mlp, idx.to(device))
    widths = [int(i.numel()) for i in keep]
    if rank == 0:
        orig = model.config.intermediate_size
        print(f"pruned in {time.time() - t0:.0f}s; widths {min(widths)}..{max(widths)} "
              f"(orig {orig}), kept {sum(widths) / (orig * len(widths)):.1%}", flush=True)

    # ---------------- recovery fine-tune ----------------
    model = model.float()
    model.train()
    model = DDP(model, device_ids=[local_rank])
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed + 1)
    loader = DataLoader(ds, batch_size=args.bs, sampler=sampler, collate_fn=collator,
                        num_workers=4, pin_memory=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    total = len(loader) * args.epochs
    sched = get_linear_schedule_with_warmup(opt, int(0.02 * total), total)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        t0 = time.time()
        for batch in loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if step % 50 == 0:
                l = loss.detach()
                dist.all_reduce(l)
                if rank == 0:
                    print(f"epoch {epoch} step {step}/{total} loss {l.item() / world:.4f} "
                          f"{(time.time() - t0) / 50:.2f}s/it", flush=True)
                t0 = time.time()

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        torch.save(model.module.state_dict(), os.path.join(args.save_dir, "model.pt"))
        model.module.config.save_pretrained(args.save_dir)
        tok.save_pretrained(args.save_dir)
        with open(os.path.join(args.save_dir, "mlp_widths.json"), "w") as f:
            json.dump(widths, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

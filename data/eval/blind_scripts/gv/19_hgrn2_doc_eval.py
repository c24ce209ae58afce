"""
HGRN2 (fla) long-context training on packed 16k rows, with a per-document evaluation:
the validation rows are split at EOS and the loss of every document is bucketed by
document length, to see whether long documents keep improving with context.

    torchrun --nproc_per_node=8 19_hgrn2_doc_eval.py --train data/books_16k_train.npy --val data/books_16k_val.npy
"""
import argparse
import contextlib
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler

from fla.models import HGRN2Config, HGRN2ForCausalLM

EOS = 2
LENGTH_BUCKETS = [0, 1024, 4096, 8192, 16384]


class RowDataset(Dataset):
    def __init__(self, path):
        self.rows = np.load(path, mmap_mode="r")

    def __len__(self):
        return self.rows.shape[0]

    def __getitem__(self, i):
        return torch.from_numpy(np.asarray(self.rows[i], dtype=np.int64))


def document_losses(token_loss, inp):
    """Split every row at EOS; return (sum_nll, n_tokens) per document, as two 1-D tensors."""
    sums, counts = [], []
    for b in range(inp.size(0)):
        ends = (inp[b] == EOS).nonzero(as_tuple=True)[0].tolist()
        start = 0
        for e in ends + [inp.size(1) - 1]:
            if e > start:
                sums.append(token_loss[b, start:e].sum())
                counts.append(e - start)
            start = e + 1
    if not sums:
        return torch.zeros(0, device=inp.device), torch.zeros(0, device=inp.device)
    return torch.stack(sums).float(), torch.tensor(counts, device=inp.device, dtype=torch.float)


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    all_sums, all_counts = [], []
    for row in loader:
        row = row.to(device)
        inp, tgt = row[:, :-1], row[:, 1:]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=inp).logits
        tok_loss = F.cross_entropy(logits.float().transpose(1, 2), tgt, reduction="none")
        s, c = document_losses(tok_loss, inp)
        all_sums.append(s)
        all_counts.append(c)
    sums = torch.cat(all_sums)
    counts = torch.cat(all_counts)

    world = dist.get_world_size()
    g_sums = [torch.zeros_like(sums) for _ in range(world)]
    g_counts = [torch.zeros_like(counts) for _ in range(world)]
    dist.all_gather(g_sums, sums)
    dist.all_gather(g_counts, counts)
    sums, counts = torch.cat(g_sums), torch.cat(g_counts)

    report = {"loss": (sums.sum() / counts.sum()).item(), "n_docs": int(sums.numel())}
    for lo, hi in zip(LENGTH_BUCKETS[:-1], LENGTH_BUCKETS[1:]):
        m = (counts > lo) & (counts <= hi)
        if m.any():
            report[f"loss_len_{lo}_{hi}"] = (sums[m].sum() / counts[m].sum()).item()
    model.train()
    return report


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--hidden_size", type=int, default=1024)
    ap.add_argument("--num_layers", type=int, default=24)
    ap.add_argument("--expand_ratio", type=int, default=128)
    ap.add_argument("--vocab_size", type=int, default=32000)
    ap.add_argument("--bs", type=int, default=2)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--warmup", type=int, default=1000)
    ap.add_argument("--steps", type=int, default=30000)
    ap.add_argument("--eval_every", type=int, default=2000)
    ap.add_argument("--val_rows", type=int, default=512)
    ap.add_argument("--out", default="out/hgrn2_16k")
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    train_ds = RowDataset(args.train)
    val_ds = RowDataset(args.val)
    val_ds = Subset(val_ds, range(rank, min(args.val_rows, len(val_ds)), world))
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=4,
                          pin_memory=True, drop_last=True)
    val_dl = DataLoader(val_ds, batch_size=args.bs, num_workers=2)

    cfg = HGRN2Config(hidden_size=args.hidden_size, num_hidden_layers=args.num_layers,
                      expand_ratio=args.expand_ratio, vocab_size=args.vocab_size,
                      attn_mode="chunk", fuse_cross_entropy=True, use_cache=False)
    model = HGRN2ForCausalLM(cfg).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup) * max(0.1, 0.5 * (1 + math.cos(math.pi * s / args.steps))))

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)

    step, micro, epoch = 0, 0, 0
    t0 = time.time()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for row in train_dl:
            row = row.to(device, non_blocking=True)
            micro += 1
            sync = micro % args.accum == 0
            ctx = model.no_sync() if not sync else contextlib.nullcontext()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(input_ids=row[:, :-1], labels=row[:, :-1]).loss
                (loss / args.accum).backward()
            if not sync:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % 25 == 0:
                l = loss.detach()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step} loss {l.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                          f"{(time.time() - t0) / 25:.2f}s/step", flush=True)
                t0 = time.time()

            if step % args.eval_every == 0:
                report = evaluate(model.module, val_dl, device)
                if rank == 0:
                    print(f"step {step} eval " + " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}"
                                                           for k, v in report.items()), flush=True)
                    torch.save({"model": model.module.state_dict(), "step": step, "eval": report},
                               os.path.join(args.out, f"step{step}.pt"))

            if step >= args.steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()

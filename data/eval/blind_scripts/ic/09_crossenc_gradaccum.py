"""Listwise cross-encoder reranker with gradient accumulation.

Groups of (1 clicked + N mined negatives) per query, LCE loss.  Tokenised groups
are cached once (rank 0) and re-used by every rank.  Large groups x long product
descriptions do not fit, so activations are checkpointed and updates are
accumulated over `accum` micro-batches.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_endpoint=$MASTER:29400 --rdzv_backend=c10d \
        09_crossenc_gradaccum.py --data /lustre/search/rerank_v3 --out /lustre/ckpt/ce_v3
"""
import argparse
import contextlib
import os
import pickle
import random
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForSequenceClassification, AutoTokenizer, get_linear_schedule_with_warmup


def args_():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="BAAI/bge-reranker-base")
    ap.add_argument("--group", type=int, default=16)
    ap.add_argument("--micro_bs", type=int, default=2, help="query groups per GPU per micro-step")
    ap.add_argument("--accum", type=int, default=8)
    ap.add_argument("--base_lr", type=float, default=1e-5, help="lr for a global batch of 256 groups")
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--max_len", type=int, default=256)
    ap.add_argument("--resume", action="store_true")
    return ap.parse_args()


def tokenize_split(tok, path, max_len):
    with open(path, "rb") as f:
        groups = pickle.load(f)  # list of dicts: qid, query, pos: [text], neg: [text], (dev) grades
    out = []
    for g in groups:
        docs = g["pos"] + g["neg"]
        enc = tok([g["query"]] * len(docs), docs, truncation="only_second", max_length=max_len)
        out.append({"qid": g["qid"], "n_pos": len(g["pos"]), "ids": enc["input_ids"],
                    "grades": g.get("grades")})
    return out


class GroupSet(Dataset):
    def __init__(self, groups, group_size):
        self.groups, self.k = groups, group_size

    def __len__(self):
        return len(self.groups)

    def __getitem__(self, i):
        g = self.groups[i]
        pos = random.randrange(g["n_pos"])
        neg_idx = list(range(g["n_pos"], len(g["ids"])))
        negs = random.sample(neg_idx, self.k - 1) if len(neg_idx) >= self.k - 1 else random.choices(neg_idx, k=self.k - 1)
        return [g["ids"][pos]] + [g["ids"][j] for j in negs]


def pad_collate(pad_id):
    def collate(batch):
        seqs = [s for grp in batch for s in grp]
        L = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), L), pad_id, dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, : len(s)] = torch.tensor(s)
        return ids, (ids != pad_id).long()
    return collate


@torch.no_grad()
def dev_ndcg(model, dev_groups, pad_id, device, rank, world, k=10):
    model.eval()
    disc = 1.0 / np.log2(np.arange(2, k + 2))
    acc = torch.zeros(2, device=device, dtype=torch.float64)
    collate = pad_collate(pad_id)
    for g in dev_groups[rank::world]:
        ids, mask = collate([g["ids"]])
        with torch.autocast("cuda", dtype=torch.bfloat16):
            s = model(input_ids=ids.to(device), attention_mask=mask.to(device)).logits.squeeze(-1).float()
        grades = np.asarray(g["grades"], dtype=np.float64)
        ranked = grades[np.argsort(-s.cpu().numpy())][:k]
        ideal = np.sort(grades)[::-1][:k]
        idcg = ((2 ** ideal - 1) * disc[: len(ideal)]).sum()
        if idcg > 0:
            acc[0] += ((2 ** ranked - 1) * disc[: len(ranked)]).sum() / idcg
            acc[1] += 1
    dist.all_reduce(acc)
    model.train()
    return (acc[0] / acc[1].clamp(min=1)).item()


def main():
    a = args_()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(7)

    tok = AutoTokenizer.from_pretrained(a.model)
    cache = os.path.join(a.data, f"tok_{a.model.replace('/', '--')}_{a.max_len}.pkl")
    if rank == 0 and not os.path.exists(cache):
        blob = {s: tokenize_split(tok, os.path.join(a.data, f"{s}_groups.pkl"), a.max_len) for s in ("train", "dev")}
        tmp = cache + f".tmp{os.getpid()}"
        with open(tmp, "wb") as f:
            pickle.dump(blob, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, cache)
    dist.barrier()
    with open(cache, "rb") as f:
        blob = pickle.load(f)
    train_groups, dev_groups = blob["train"], blob["dev"]

    global_groups = a.micro_bs * a.accum * world
    lr = a.base_lr * global_groups / 256
    if rank == 0:
        print(f"{len(train_groups):,} train groups, global batch {global_groups} groups, lr {lr:.2e}", flush=True)

    model = AutoModelForSequenceClassification.from_pretrained(a.model, num_labels=1)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.to(device)

    ds = GroupSet(train_groups, a.group)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    loader = DataLoader(ds, batch_size=a.micro_bs, sampler=sampler, collate_fn=pad_collate(tok.pad_token_id),
                        num_workers=4, pin_memory=True, drop_last=True)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    updates_per_epoch = len(loader) // a.accum
    sched = get_linear_schedule_with_warmup(opt, int(0.05 * updates_per_epoch * a.epochs),
                                            updates_per_epoch * a.epochs)

    start_epoch = 0
    ckpt_path = os.path.join(a.out, "last.pt")
    if a.resume and os.path.exists(ckpt_path):
        state = torch.load(ckpt_path, map_location="cpu")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        start_epoch = state["epoch"] + 1
    ddp = DDP(model, device_ids=[local_rank])

    for epoch in range(start_epoch, a.epochs):
        sampler.set_epoch(epoch)
        ddp.train()
        t0 = time.time()
        n_micro = updates_per_epoch * a.accum
        for i, (ids, mask) in enumerate(loader):
            if i >= n_micro:
                break
            sync_now = (i + 1) % a.accum == 0
            ctx = contextlib.nullcontext() if sync_now else ddp.no_sync()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    logits = ddp(input_ids=ids.to(device, non_blocking=True),
                                 attention_mask=mask.to(device, non_blocking=True)).logits
                logits = logits.float().view(-1, a.group)
                loss = F.cross_entropy(logits, torch.zeros(logits.size(0), dtype=torch.long, device=device))
                (loss / a.accum).backward()
            if sync_now:
                torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
                opt.step()
                sched.step()
                opt.zero_grad(set_to_none=True)
                upd = (i + 1) // a.accum
                if rank == 0 and upd % 50 == 0:
                    print(f"epoch {epoch} update {upd}/{updates_per_epoch} loss {loss.item():.4f} "
                          f"({time.time() - t0:.0f}s)", flush=True)

        ndcg = dev_ndcg(model, dev_groups, tok.pad_token_id, device, rank, world)
        if rank == 0:
            print(f"epoch {epoch} dev nDCG@10 {ndcg:.4f}", flush=True)
            os.makedirs(a.out, exist_ok=True)
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "epoch": epoch, "ndcg": ndcg}, ckpt_path + ".tmp")
            os.replace(ckpt_path + ".tmp", ckpt_path)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()

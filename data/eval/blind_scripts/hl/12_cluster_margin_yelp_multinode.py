"""Cluster-margin style active learning on Yelp-5 with BERT, multi-node.

Round r:  fine-tune bert-base-cased on the labelled set -> score the pool by
margin -> keep the `cand_factor * budget` lowest-margin candidates -> cluster their
[CLS] embeddings and take the candidate nearest to each centroid.

out_dir and hf_cache must be on storage shared by all nodes.

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_id=al_yelp --rdzv_backend=c10d \
        --rdzv_endpoint=node01:29400 12_cluster_margin_yelp_multinode.py \
        --out_dir /mnt/shared/al/yelp_cm --hf_cache /mnt/shared/hf_cache
"""
import argparse
import datetime
import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import wandb
from datasets import load_dataset
from sklearn.cluster import MiniBatchKMeans
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from transformers import (AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding,
                          get_linear_schedule_with_warmup)


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bert-base-cased")
    ap.add_argument("--out_dir", required=True)
    ap.add_argument("--hf_cache", required=True)
    ap.add_argument("--init_size", type=int, default=2000)
    ap.add_argument("--budget", type=int, default=2000)
    ap.add_argument("--cand_factor", type=int, default=10)
    ap.add_argument("--pool_sample", type=int, default=100000, help="pool subsample scored per round")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--global_batch", type=int, default=128)
    ap.add_argument("--lr", type=float, default=4e-5, help="for the global batch above")
    ap.add_argument("--max_len", type=int, default=256)
    ap.add_argument("--wandb_project", default="al-yelp")
    ap.add_argument("--seed", type=int, default=11)
    return ap.parse_args()


def load_tokenized(args, tokenizer, rank):
    def tok(batch):
        return tokenizer(batch["text"], truncation=True, max_length=args.max_len)

    # global rank 0 builds the Arrow cache on shared storage, everyone else reuses it
    if rank != 0:
        dist.barrier()
    raw = load_dataset("yelp_review_full", cache_dir=args.hf_cache)
    ds = raw.map(tok, batched=True, remove_columns=["text"], num_proc=8)
    if rank == 0:
        dist.barrier()
    return ds["train"], ds["test"]


def finetune(model, train_ds, labelled, collate, args, device, world):
    sub = Subset(train_ds, labelled)
    sampler = DistributedSampler(sub, shuffle=True, seed=args.seed)
    loader = DataLoader(sub, batch_size=args.global_batch // world, sampler=sampler,
                        collate_fn=collate, num_workers=4, pin_memory=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    total = args.epochs * len(loader)
    sched = get_linear_schedule_with_warmup(opt, int(0.1 * total), total)
    model.train()
    losses = []
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for batch in loader:
            batch = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
    mean_loss = torch.stack(losses).mean()
    dist.all_reduce(mean_loss, op=dist.ReduceOp.AVG)
    return mean_loss.item()


@torch.no_grad()
def evaluate(net, test_ds, collate, device, rank, world):
    # strided shard without padding; plain module, so uneven shard sizes are fine
    loader = DataLoader(Subset(test_ds, list(range(rank, len(test_ds), world))), batch_size=256,
                        collate_fn=collate, num_workers=4)
    net.eval()
    c = torch.zeros(2, device=device, dtype=torch.float64)
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items()}
        labels = batch.pop("labels")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = net(**batch).logits.argmax(-1)
        c[0] += (pred == labels).sum()
        c[1] += labels.numel()
    dist.all_reduce(c)
    return (c[0] / c[1]).item()


@torch.no_grad()
def margin_and_embed(net, train_ds, pool, collate, device, world):
    sub = Subset(train_ds, pool)
    sampler = DistributedSampler(sub, shuffle=False)
    loader = DataLoader(sub, batch_size=256, sampler=sampler, collate_fn=collate, num_workers=4)
    net.eval()
    margins, embs = [], []
    for batch in loader:
        batch = {k: v.to(device) for k, v in batch.items() if k != "labels"}
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = net(**batch, output_hidden_states=True)
        p = F.softmax(out.logits.float(), -1).topk(2, -1).values
        margins.append(p[:, 0] - p[:, 1])
        embs.append(out.hidden_states[-1][:, 0].float())
    margins, embs = torch.cat(margins), torch.cat(embs)
    pos = torch.tensor(list(sampler), device=device)
    res = []
    for t in (margins, embs, pos):
        bufs = [torch.empty_like(t) for _ in range(world)]
        dist.all_gather(bufs, t)
        res.append(torch.cat(bufs))
    return res


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # clustering on rank 0 can take a few minutes while the others wait in broadcast
    dist.init_process_group("nccl", timeout=datetime.timedelta(minutes=60))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tokenizer = AutoTokenizer.from_pretrained(args.model, cache_dir=args.hf_cache)
    train_ds, test_ds = load_tokenized(args, tokenizer, rank)
    collate = DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8)

    run = None
    if rank == 0:
        os.makedirs(args.out_dir, exist_ok=True)
        run = wandb.init(project=args.wandb_project, config=vars(args), dir=args.out_dir)

    state_file = os.path.join(args.out_dir, "al_state.json")
    if os.path.exists(state_file):
        with open(state_file) as f:
            state = json.load(f)
        labelled, start = state["labelled"], state["round"] + 1
    else:
        labelled = np.random.default_rng(args.seed).choice(len(train_ds), args.init_size, replace=False).tolist()
        start = 0
    dist.barrier()  # nobody may see a state file that rank 0 writes below before reading it here

    for rnd in range(start, args.rounds + 1):
        t0 = time.time()
        torch.manual_seed(args.seed + rnd)
        net = AutoModelForSequenceClassification.from_pretrained(args.model, num_labels=5,
                                                                 cache_dir=args.hf_cache).to(device)
        model = DDP(net, device_ids=[local_rank])
        train_loss = finetune(model, train_ds, labelled, collate, args, device, world)
        acc = evaluate(net, test_ds, collate, device, rank, world)
        if rank == 0:
            print(f"round {rnd}: n={len(labelled)} loss={train_loss:.4f} acc={acc:.4f} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            run.log({"round": rnd, "n_labelled": len(labelled), "test_acc": acc, "train_loss": train_loss})
            net.save_pretrained(os.path.join(args.out_dir, f"round_{rnd:02d}"))
        if rnd == args.rounds:
            break

        lab = set(labelled)
        pool = [i for i in range(len(train_ds)) if i not in lab]
        sub_rng = np.random.default_rng(args.seed * 1000 + rnd)  # same subsample on every rank
        pool = sorted(sub_rng.choice(pool, min(args.pool_sample, len(pool)), replace=False).tolist())
        margins, embs, pos = margin_and_embed(net, train_ds, pool, collate, device, world)
        picked = [None]
        if rank == 0:
            uniq = {}
            for m, e, p in zip(margins.tolist(), range(len(pos)), pos.tolist()):
                if p not in uniq or m < uniq[p][0]:
                    uniq[p] = (m, e)
            cand = sorted(uniq.items(), key=lambda kv: kv[1][0])[: args.cand_factor * args.budget]
            cand_pos = [p for p, _ in cand]
            X = F.normalize(embs[[e for _, (_, e) in cand]], dim=-1).cpu().numpy()
            km = MiniBatchKMeans(n_clusters=args.budget, random_state=args.seed, batch_size=4096, n_init=3).fit(X)
            d = X @ km.cluster_centers_.T  # cosine-like similarity, [n_cand, budget]
            nearest = np.unique(d.argmax(0))
            picked = [[pool[cand_pos[j]] for j in nearest.tolist()]]
        dist.broadcast_object_list(picked, src=0)
        labelled = labelled + picked[0]
        if rank == 0:
            with open(state_file + ".tmp", "w") as f:
                json.dump({"round": rnd, "labelled": labelled}, f)
            os.replace(state_file + ".tmp", state_file)
        del model, net
        torch.cuda.empty_cache()

    if rank == 0:
        run.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

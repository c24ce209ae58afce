"""
Contrastive fine-tuning of a text embedding model (in-batch negatives gathered across
all ranks) on streamed question/answer pairs. Runs as a Kubeflow PyTorchJob, 2 pods x 8 GPUs;
every pod runs:

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d \
        --rdzv_endpoint=${MASTER_ADDR}:29400 --rdzv_id=${JOB_ID} --max_restarts=3 \
        18_embed_contrastive_multinode.py --out /mnt/shared/embed_gooaq
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_fn
import torch.nn.functional as F
from datasets import load_dataset
from datasets.distributed import split_dataset_by_node
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from transformers import AutoModel, AutoTokenizer


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="BAAI/bge-base-en-v1.5")
    p.add_argument("--dataset", default="sentence-transformers/gooaq")
    p.add_argument("--dev", default="/mnt/shared/dev_pairs.jsonl")
    p.add_argument("--out", required=True)
    p.add_argument("--bs", type=int, default=128, help="pairs per GPU")
    p.add_argument("--max_len", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--temp", type=float, default=0.05)
    p.add_argument("--max_steps", type=int, default=8000)
    p.add_argument("--warmup", type=int, default=400)
    p.add_argument("--eval_every", type=int, default=1000)
    p.add_argument("--ckpt_every", type=int, default=500)
    return p.parse_args()


def embed(model, enc):
    out = model(**enc).last_hidden_state
    mask = enc["attention_mask"].unsqueeze(-1).to(out.dtype)
    pooled = (out * mask).sum(1) / mask.sum(1).clamp(min=1e-6)
    return F.normalize(pooled.float(), dim=-1)


def make_loader(args, tok, rank, world, seed):
    stream = load_dataset(args.dataset, split="train", streaming=True)
    stream = stream.shuffle(seed=seed, buffer_size=50_000)
    stream = split_dataset_by_node(stream, rank=rank, world_size=world)

    def collate(rows):
        q = tok([r["question"] for r in rows], padding=True, truncation=True,
                max_length=64, return_tensors="pt")
        d = tok([r["answer"] for r in rows], padding=True, truncation=True,
                max_length=args.max_len, return_tensors="pt")
        return q, d

    return DataLoader(stream, batch_size=args.bs, collate_fn=collate, num_workers=2,
                      drop_last=True)


@torch.no_grad()
def recall_at_1(model, tok, pairs, rank, world, device, bs=256):
    model.eval()
    mine = pairs[rank::world]
    per = (len(pairs) + world - 1) // world

    def enc_all(texts, max_len):
        chunks = []
        for i in range(0, len(texts), bs):
            e = tok(texts[i:i + bs], padding=True, truncation=True, max_length=max_len,
                    return_tensors="pt").to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                chunks.append(embed(model, e))
        x = torch.cat(chunks) if chunks else torch.zeros(0, model.config.hidden_size, device=device)
        pad = torch.zeros(per - x.size(0), x.size(1), device=device)
        x = torch.cat([x, pad])
        gathered = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(gathered, x)
        # shard r holds indices r, r+world, ... -> interleave back into dataset order
        return torch.stack(gathered, 1).reshape(-1, x.size(1))[: len(pairs)]

    q = enc_all([p["question"] for p in mine], 64)
    d = enc_all([p["answer"] for p in mine], 256)
    hits = (q @ d.t()).argmax(1) == torch.arange(len(pairs), device=device)
    model.train()
    return hits.float().mean().item()


def save_ckpt(path, model, opt, step):
    tmp = path + ".tmp"
    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "step": step}, tmp)
    os.replace(tmp, path)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModel.from_pretrained(args.model).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)

    step = 0
    ckpt = os.path.join(args.out, "last.pt")
    if os.path.exists(ckpt):
        state = torch.load(ckpt, map_location="cpu")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step = state["step"]
    model = DDP(model, device_ids=[local_rank])
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / args.warmup) * max(0.0, 1 - s / args.max_steps),
        last_epoch=-1)
    for _ in range(step):
        sched.step()

    with open(args.dev) as f:
        dev_pairs = [json.loads(l) for l in f][:5000]
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"world={world} global batch={args.bs * world} start step={step}", flush=True)

    loader = make_loader(args, tok, rank, world, seed=1234 + step)
    it = iter(loader)
    t0 = time.time()
    while step < args.max_steps:
        try:
            q, d = next(it)
        except StopIteration:
            it = iter(loader)
            q, d = next(it)
        q, d = q.to(device), d.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            qe = embed(model, q)
            de = embed(model, d)
        all_d = torch.cat(dist_fn.all_gather(de), 0)
        logits = qe @ all_d.t() / args.temp
        target = torch.arange(qe.size(0), device=device) + rank * qe.size(0)
        loss = F.cross_entropy(logits, target)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        step += 1

        if step % 50 == 0:
            l = loss.detach()
            dist.all_reduce(l, op=dist.ReduceOp.AVG)
            if rank == 0:
                print(f"step {step} loss {l.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                      f"{(time.time() - t0) / 50:.3f}s/it", flush=True)
            t0 = time.time()
        if step % args.eval_every == 0:
            r1 = recall_at_1(model.module, tok, dev_pairs, rank, world, device)
            if rank == 0:
                print(f"step {step} dev recall@1 {r1:.4f}", flush=True)
        if step % args.ckpt_every == 0:
            if rank == 0:
                save_ckpt(ckpt, model, opt, step)
            dist.barrier()

    if rank == 0:
        model.module.save_pretrained(os.path.join(args.out, "final"))
        tok.save_pretrained(os.path.join(args.out, "final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

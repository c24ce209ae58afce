"""Contrastive fine-tuning of a text-embedding model with cross-GPU in-batch negatives.
DeepSpeed ZeRO-1, bf16.

torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $MASTER:29400 \
    embedding_contrastive.py --pairs /shared/data/retrieval_pairs.jsonl --out /shared/ckpt/emb-v3 \
    --init_head /shared/ckpt/emb-v2/proj_head.pt
"""
import argparse
import json
import math
import os

import deepspeed
import torch
import torch.distributed as dist
import torch.distributed.nn as dist_nn
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoTokenizer


def args_():
    p = argparse.ArgumentParser()
    p.add_argument("--encoder", default="BAAI/bge-large-en-v1.5")
    p.add_argument("--pairs", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--init_head", default=None)
    p.add_argument("--proj_dim", type=int, default=768)
    p.add_argument("--batch_per_gpu", type=int, default=128)
    p.add_argument("--lr", type=float, default=2e-5)
    p.add_argument("--base_global_batch", type=int, default=2048, help="global batch the lr was tuned for")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--temperature", type=float, default=0.02)
    p.add_argument("--q_len", type=int, default=64)
    p.add_argument("--p_len", type=int, default=256)
    return p.parse_args()


class Pairs(Dataset):
    def __init__(self, path):
        with open(path) as f:
            self.rows = [json.loads(l) for l in f]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return "query: " + self.rows[i]["query"], "passage: " + self.rows[i]["positive"]


class BiEncoder(nn.Module):
    def __init__(self, name, proj_dim):
        super().__init__()
        self.encoder = AutoModel.from_pretrained(name)
        self.encoder.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.proj = nn.Linear(self.encoder.config.hidden_size, proj_dim)

    def embed(self, ids, mask):
        h = self.encoder(input_ids=ids, attention_mask=mask).last_hidden_state
        pooled = (h * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True).clamp(min=1)
        return F.normalize(self.proj(pooled).float(), dim=-1)

    def forward(self, q_ids, q_mask, p_ids, p_mask):
        return self.embed(q_ids, q_mask), self.embed(p_ids, p_mask)


def main():
    args = args_()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()

    tok = AutoTokenizer.from_pretrained(args.encoder)
    model = BiEncoder(args.encoder, args.proj_dim)
    if args.init_head:
        # saved from a GPU run; load to CPU on every rank and let deepspeed place it
        head_sd = torch.load(args.init_head, map_location="cpu")
        model.proj.load_state_dict(head_sd)

    ds = Pairs(args.pairs)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True)

    def collate(batch):
        qs, ps = zip(*batch)
        q = tok(list(qs), max_length=args.q_len, truncation=True, padding=True, return_tensors="pt")
        p = tok(list(ps), max_length=args.p_len, truncation=True, padding=True, return_tensors="pt")
        return q["input_ids"], q["attention_mask"], p["input_ids"], p["attention_mask"]

    # drop_last on both the sampler and the loader: the all_gather below needs equal batch sizes on every rank
    loader = DataLoader(ds, batch_size=args.batch_per_gpu, sampler=sampler, collate_fn=collate,
                        num_workers=4, drop_last=True)

    global_batch = args.batch_per_gpu * world
    lr = args.lr * math.sqrt(global_batch / args.base_global_batch)
    total = len(loader) * args.epochs
    cfg = {
        "train_micro_batch_size_per_gpu": args.batch_per_gpu,
        "gradient_accumulation_steps": 1,
        "train_batch_size": global_batch,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 1},
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupDecayLR",
                      "params": {"warmup_min_lr": 0, "warmup_max_lr": lr,
                                 "warmup_num_steps": max(1, int(0.1 * total)), "total_num_steps": total}},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    if rank == 0:
        print(f"world={world} global_batch={global_batch} lr={lr:.2e} steps={total}", flush=True)

    start_epoch = 0
    if os.path.exists(os.path.join(args.out, "latest")):
        _, cs = engine.load_checkpoint(args.out)
        start_epoch = cs["epoch"] + 1

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        engine.train()
        stats = torch.zeros(3, device=engine.device)
        for qi, qm, pi, pm in loader:
            q, p = engine(qi.to(engine.device), qm.to(engine.device), pi.to(engine.device), pm.to(engine.device))
            # autograd-aware gather: negatives from every GPU, gradients flow back to their owners
            all_p = torch.cat(dist_nn.all_gather(p), dim=0)
            logits = q @ all_p.T / args.temperature
            target = torch.arange(q.size(0), device=q.device) + rank * q.size(0)
            loss = F.cross_entropy(logits, target)
            engine.backward(loss)
            engine.step()

            acc = (logits.argmax(-1) == target).float().mean()
            stats += torch.stack([loss.detach(), acc, torch.ones((), device=engine.device)])
            if engine.global_steps % 50 == 0:
                snap = stats.clone()
                dist.all_reduce(snap)
                if rank == 0:
                    print(f"epoch {epoch} step {engine.global_steps} loss {(snap[0] / snap[2]).item():.4f} "
                          f"in-batch acc {(snap[1] / snap[2]).item():.3f}", flush=True)
                stats.zero_()

        engine.save_checkpoint(args.out, tag=f"epoch{epoch}", client_state={"epoch": epoch})
        if rank == 0:
            # ZeRO-1 keeps full bf16 weights on every rank, so rank 0 can export directly
            export = os.path.join(args.out, f"export_epoch{epoch}")
            engine.module.encoder.save_pretrained(export)
            tok.save_pretrained(export)
            torch.save({k: v.cpu() for k, v in engine.module.proj.state_dict().items()},
                       os.path.join(export, "proj_head.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()

# bi-encoder fine-tune (e5-style) with cross-device in-batch negatives
# torchrun --nproc_per_node=8 05_retrieval_inbatch_negs.py --train data/msmarco_triples.jsonl --bsz 64
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter
from transformers import AutoModel, AutoTokenizer, get_linear_schedule_with_warmup


class Encoder(torch.nn.Module):
    def __init__(self, name, pooling="mean"):
        super().__init__()
        self.backbone = AutoModel.from_pretrained(name)
        self.pooling = pooling

    def encode(self, input_ids, attention_mask):
        h = self.backbone(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        if self.pooling == "cls":
            emb = h[:, 0]
        else:
            m = attention_mask.unsqueeze(-1).to(h.dtype)
            emb = (h * m).sum(1) / m.sum(1).clamp(min=1e-6)
        return F.normalize(emb, dim=-1)

    def forward(self, q, p):
        # one DDP forward per step for both towers (shared weights)
        return self.encode(**q), self.encode(**p)


class Pairs(Dataset):
    def __init__(self, path):
        self.rows = [json.loads(l) for l in open(path, encoding="utf-8")]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        return "query: " + r["query"].strip(), "passage: " + r["positive"].strip()


class PairCollator:
    def __init__(self, tok, q_len, p_len, min_passage_chars=32):
        self.tok, self.q_len, self.p_len = tok, q_len, p_len
        self.min_chars = min_passage_chars

    def __call__(self, batch):
        # drop junk pairs (empty passages / boilerplate) instead of cleaning the whole corpus up front
        batch = [(q, p) for q, p in batch if len(p) >= self.min_chars and len(q) > len("query: ")]
        qs, ps = zip(*batch)
        q = self.tok(list(qs), max_length=self.q_len, truncation=True, padding=True, return_tensors="pt")
        p = self.tok(list(ps), max_length=self.p_len, truncation=True, padding=True, return_tensors="pt")
        return q, p


def gather_with_grad(x, rank, world):
    if world == 1:
        return x
    bufs = [torch.zeros_like(x) for _ in range(world)]
    dist.all_gather(bufs, x.detach().contiguous())
    bufs[rank] = x  # keep the local slice in the graph
    return torch.cat(bufs, dim=0)


def contrastive_loss(q, p, temperature, rank, world):
    all_p = gather_with_grad(p, rank, world)
    all_q = gather_with_grad(q, rank, world)
    offset = rank * q.size(0)
    labels = torch.arange(q.size(0), device=q.device) + offset
    logits_qp = q @ all_p.T / temperature
    logits_pq = p @ all_q.T / temperature
    return 0.5 * (F.cross_entropy(logits_qp, labels) + F.cross_entropy(logits_pq, labels))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="intfloat/e5-base-v2")
    ap.add_argument("--train", required=True)
    ap.add_argument("--out", default="ckpt/e5_ft")
    ap.add_argument("--bsz", type=int, default=64, help="per-GPU")
    ap.add_argument("--q_len", type=int, default=64)
    ap.add_argument("--p_len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.02)
    ap.add_argument("--warmup", type=int, default=500)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{local_rank}")
    torch.manual_seed(1337)

    tok = AutoTokenizer.from_pretrained(args.model)
    model = Encoder(args.model).to(device)
    model.backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = DDP(model, device_ids=[local_rank])

    ds = Pairs(args.train)
    sampler = DistributedSampler(ds, shuffle=True, drop_last=True)
    dl = DataLoader(ds, batch_size=args.bsz, sampler=sampler, collate_fn=PairCollator(tok, args.q_len, args.p_len),
                    num_workers=4, pin_memory=True, drop_last=True)

    no_decay = ("bias", "LayerNorm.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if not any(k in n for k in no_decay)], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if any(k in n for k in no_decay)], "weight_decay": 0.0},
    ]
    opt = torch.optim.AdamW(groups, lr=args.lr)
    total = len(dl) * args.epochs
    sched = get_linear_schedule_with_warmup(opt, args.warmup, total)
    scaler_dtype = torch.bfloat16

    writer = SummaryWriter(os.path.join(args.out, "tb")) if rank == 0 else None
    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0 = time.time()
        for q, p in dl:
            q = {k: v.to(device, non_blocking=True) for k, v in q.items()}
            p = {k: v.to(device, non_blocking=True) for k, v in p.items()}
            with torch.autocast("cuda", dtype=scaler_dtype):
                q_emb, p_emb = model(q, p)
            loss = contrastive_loss(q_emb.float(), p_emb.float(), args.temperature, rank, world)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            step += 1

            if step % 50 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    writer.add_scalar("train/loss", l.item(), step)
                    writer.add_scalar("train/lr", sched.get_last_lr()[0], step)
                    print(f"ep {epoch} step {step}/{total} loss {l.item():.4f} "
                          f"({(time.time() - t0) / 50:.2f}s/step)", flush=True)
                t0 = time.time()

        if rank == 0:
            save_dir = os.path.join(args.out, f"epoch{epoch}")
            os.makedirs(save_dir, exist_ok=True)
            model.module.backbone.save_pretrained(save_dir)
            tok.save_pretrained(save_dir)
        dist.barrier()

    if writer is not None:
        writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""
T5-large fine-tuning (summarisation) with a hand-written ZeRO-1 AdamW.

DDP averages the gradients as usual; the AdamW moments only exist for the
parameters a rank owns (contiguous partition balanced by numel). After the
local update every owner broadcasts its parameters. Each rank checkpoints its
own optimizer shard; the model is written once by rank 0.

    torchrun --nproc_per_node=8 16_zero1_handwritten_t5.py --data /data/cnn_dm_tok --resume
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
from datasets import load_from_disk
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoTokenizer, T5ForConditionalGeneration


class Zero1AdamW:
    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        self.params = [p for p in params if p.requires_grad]
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.lr, self.betas, self.eps, self.wd = lr, betas, eps, weight_decay
        total = sum(p.numel() for p in self.params)
        target = total / self.world
        self.owner, acc, r = [], 0, 0
        for p in self.params:
            if acc >= target * (r + 1) and r < self.world - 1:
                r += 1
            self.owner.append(r)
            acc += p.numel()
        self.local = [p for p, o in zip(self.params, self.owner) if o == self.rank]
        self.exp_avg = [torch.zeros_like(p, dtype=torch.float32) for p in self.local]
        self.exp_avg_sq = [torch.zeros_like(p, dtype=torch.float32) for p in self.local]
        self.step_count = 0

    @torch.no_grad()
    def step(self):
        self.step_count += 1
        b1, b2 = self.betas
        bc1, bc2 = 1 - b1 ** self.step_count, 1 - b2 ** self.step_count
        for p, m, v in zip(self.local, self.exp_avg, self.exp_avg_sq):
            if p.grad is None:
                continue
            g = p.grad.float()
            m.mul_(b1).add_(g, alpha=1 - b1)
            v.mul_(b2).addcmul_(g, g, value=1 - b2)
            denom = (v / bc2).sqrt_().add_(self.eps)
            p.mul_(1 - self.lr * self.wd)
            p.addcdiv_(m, denom, value=-self.lr / bc1)
        for p, o in zip(self.params, self.owner):
            dist.broadcast(p.data, src=o)

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    def state_dict(self):
        return {"step": self.step_count, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq,
                "world_size": self.world}

    def load_state_dict(self, sd):
        assert sd["world_size"] == self.world, "optimizer shards were written with another world size"
        self.step_count = sd["step"]
        for dst, src in zip(self.exp_avg, sd["exp_avg"]):
            dst.copy_(src)
        for dst, src in zip(self.exp_avg_sq, sd["exp_avg_sq"]):
            dst.copy_(src)


def build_loader(ds, tok, batch_size, shuffle):
    sampler = DistributedSampler(ds, shuffle=shuffle, drop_last=shuffle)

    def collate(rows):
        enc = tok.pad({"input_ids": [r["input_ids"] for r in rows]}, return_tensors="pt")
        lab = tok.pad({"input_ids": [r["labels"] for r in rows]}, return_tensors="pt")["input_ids"]
        lab[lab == tok.pad_token_id] = -100
        return enc["input_ids"], enc["attention_mask"], lab

    return DataLoader(ds, batch_size=batch_size, sampler=sampler, collate_fn=collate,
                      num_workers=4, pin_memory=True), sampler


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--model", default="t5-large")
    ap.add_argument("--batch_size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--save_every", type=int, default=2000)
    ap.add_argument("--ckpt_dir", default="/nfs/ckpt/t5l_zero1")
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained(args.model)
    model = T5ForConditionalGeneration.from_pretrained(args.model).to(device)
    optim = Zero1AdamW(model.parameters(), lr=args.lr)

    step = 0
    if args.resume and os.path.exists(os.path.join(args.ckpt_dir, "model.pt")):
        ckpt = torch.load(os.path.join(args.ckpt_dir, "model.pt"))
        model.load_state_dict(ckpt["model"])
        step = ckpt["step"]
        optim.load_state_dict(torch.load(os.path.join(args.ckpt_dir, f"optim_rank{rank}.pt")))
        del ckpt

    model = DDP(model, device_ids=[local_rank])
    ds = load_from_disk(args.data)
    train_dl, train_sampler = build_loader(ds["train"], tok, args.batch_size, shuffle=True)
    val_dl, _ = build_loader(ds["validation"], tok, args.batch_size * 2, shuffle=False)
    steps_per_epoch = len(train_dl)
    total = args.epochs * steps_per_epoch
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        print(f"rank0 holds optimizer state for {sum(p.numel() for p in optim.local) / 1e6:.1f}M params, "
              f"resuming at step {step}")

    def save():
        if rank == 0:
            torch.save({"model": model.module.state_dict(), "step": step}, os.path.join(args.ckpt_dir, "model.pt"))
        torch.save(optim.state_dict(), os.path.join(args.ckpt_dir, f"optim_rank{rank}.pt"))
        dist.barrier()

    model.train()
    start_epoch = step // steps_per_epoch
    for epoch in range(start_epoch, args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for i, (ids, mask, labels) in enumerate(train_dl):
            if epoch * steps_per_epoch + i < step:
                continue  # fast-forward inside the resumed epoch
            optim.lr = args.lr * min(1.0, (step + 1) / 500) * max(0.0, 1 - step / total)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids.to(device), attention_mask=mask.to(device),
                             labels=labels.to(device)).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            optim.zero_grad()
            step += 1
            if rank == 0 and step % 50 == 0:
                print(f"ep {epoch} step {step}/{total} loss {loss.item():.4f} "
                      f"{(time.time() - t0) / (i + 1):.2f}s/it")
            if step % args.save_every == 0:
                save()

        model.eval()
        agg = torch.zeros(2, device=device)
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            for ids, mask, labels in val_dl:
                labels = labels.to(device)
                out = model(input_ids=ids.to(device), attention_mask=mask.to(device), labels=labels)
                n = (labels != -100).sum()
                agg += torch.stack([out.loss.float() * n, n.float()])
        dist.all_reduce(agg)
        model.train()
        if rank == 0:
            print(f"epoch {epoch} val_loss {(agg[0] / agg[1]).item():.4f}")
        save()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()

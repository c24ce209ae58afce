"""
BERT-base MLM pretraining with a hand-rolled sharded LAMB (ZeRO-2 style).

  * every parameter has an owner rank (greedy partition by size)
  * gradients are reduced to the owner only (dist.reduce), not all-reduced
  * owners clip with the *global* gradient norm, run LAMB on their parameters
    and broadcast the new values back to the other ranks

Run:
  torchrun --nproc_per_node=8 08_sharded_lamb_bert.py --train data/wiki_bc_128.npy --val data/wiki_val_128.npy
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import BertConfig, BertForMaskedLM

MASK_ID, PAD_ID, VOCAB = 103, 0, 30522


class TokenBlocks(Dataset):
    def __init__(self, path):
        self.data = np.load(path, mmap_mode="r")

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        return torch.from_numpy(self.data[i].astype(np.int64))


def mlm_collate(batch, mask_prob=0.15):
    ids = torch.stack(batch)
    labels = ids.clone()
    special = (ids == PAD_ID) | (ids == 101) | (ids == 102)
    prob = torch.full(ids.shape, mask_prob)
    prob.masked_fill_(special, 0.0)
    masked = torch.bernoulli(prob).bool()
    labels[~masked] = -100
    replace = torch.bernoulli(torch.full(ids.shape, 0.8)).bool() & masked
    ids[replace] = MASK_ID
    rand = torch.bernoulli(torch.full(ids.shape, 0.5)).bool() & masked & ~replace
    ids[rand] = torch.randint(VOCAB, ids.shape)[rand]
    return ids, (ids != PAD_ID).long(), labels


class ShardedLAMB:
    def __init__(self, named_params, lr, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, max_grad_norm=1.0):
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.params = [p for _, p in named_params]
        self.no_decay = {id(p) for n, p in named_params if p.ndim == 1}
        self.lr, self.betas, self.eps, self.wd, self.max_grad_norm = lr, betas, eps, weight_decay, max_grad_norm
        load = [0] * self.world
        self.owner = {}
        for p in sorted(self.params, key=lambda t: -t.numel()):
            r = min(range(self.world), key=lambda k: load[k])
            self.owner[id(p)] = r
            load[r] += p.numel()
        self.mine = [p for p in self.params if self.owner[id(p)] == self.rank]
        self.state = {id(p): {"m": torch.zeros_like(p), "v": torch.zeros_like(p)} for p in self.mine}
        self.t = 0

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def reduce_grads(self):
        handles = []
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            handles.append(dist.reduce(p.grad, dst=self.owner[id(p)], async_op=True))
        for h in handles:
            h.wait()
        for p in self.mine:
            p.grad.div_(self.world)

    @torch.no_grad()
    def global_grad_norm(self):
        local_sq = 0.0
        for p in self.mine:
            local_sq += p.grad.float().pow(2).sum().item()
        total = torch.tensor([local_sq], dtype=torch.float64)
        dist.all_reduce(total)
        return math.sqrt(total.item())

    @torch.no_grad()
    def step(self):
        self.reduce_grads()
        gnorm = self.global_grad_norm()
        clip = min(1.0, self.max_grad_norm / (gnorm + 1e-6))
        self.t += 1
        b1, b2 = self.betas
        bc1, bc2 = 1 - b1 ** self.t, 1 - b2 ** self.t
        for p in self.mine:
            st = self.state[id(p)]
            g = p.grad.mul(clip)
            st["m"].mul_(b1).add_(g, alpha=1 - b1)
            st["v"].mul_(b2).addcmul_(g, g, value=1 - b2)
            update = (st["m"] / bc1) / ((st["v"] / bc2).sqrt() + self.eps)
            if id(p) not in self.no_decay:
                update.add_(p, alpha=self.wd)
            w_norm, u_norm = p.norm(), update.norm()
            trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
            p.add_(update, alpha=-self.lr * trust.item())
        for p in self.params:
            dist.broadcast(p.data, src=self.owner[id(p)])
        return gnorm

    def state_dict(self):
        return {"t": self.t, "state": [self.state[id(p)] for p in self.mine]}


def lr_schedule(step, peak, warmup, total):
    if step < warmup:
        return peak * step / warmup
    return peak * max(0.0, (total - step) / (total - warmup))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--batch_size", type=int, default=64, help="sequences per GPU")
    ap.add_argument("--lr", type=float, default=6e-3)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=70000)
    ap.add_argument("--eval_every", type=int, default=2000)
    ap.add_argument("--save_dir", default="ckpt/bert_lamb")
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    model = BertForMaskedLM(BertConfig(vocab_size=VOCAB)).to(device)
    with torch.no_grad():
        for p in model.parameters():
            dist.broadcast(p.data, src=0)
    optim = ShardedLAMB(list(model.named_parameters()), lr=args.lr)

    train_ds, val_ds = TokenBlocks(args.train), TokenBlocks(args.val)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, collate_fn=mlm_collate,
                        num_workers=4, pin_memory=True, drop_last=True)
    val_loader = DataLoader(val_ds, batch_size=args.batch_size, collate_fn=mlm_collate,
                            sampler=DistributedSampler(val_ds, shuffle=False), num_workers=2)
    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
        print(f"rank0 owns {sum(p.numel() for p in optim.mine) / 1e6:.1f}M params")

    step, epoch = 0, 0
    t0 = time.time()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for ids, attn, labels in loader:
            ids, attn, labels = ids.to(device), attn.to(device), labels.to(device)
            optim.lr = lr_schedule(step, args.lr, args.warmup, args.steps)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
            loss.backward()
            gnorm = optim.step()
            optim.zero_grad()
            step += 1

            if rank == 0 and step % 50 == 0:
                print(f"step {step} loss {loss.item():.4f} gnorm {gnorm:.3f} lr {optim.lr:.2e} "
                      f"{(time.time() - t0) / 50:.3f}s/it")
                t0 = time.time()

            if step % args.eval_every == 0:
                model.eval()
                tot = torch.zeros(2, device=device)
                with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                    for vids, vattn, vlabels in val_loader:
                        out = model(input_ids=vids.to(device), attention_mask=vattn.to(device),
                                    labels=vlabels.to(device))
                        tot += torch.stack([out.loss.float(), torch.ones((), device=device)])
                dist.all_reduce(tot)
                model.train()
                if rank == 0:
                    print(f"step {step} val_mlm_loss {(tot[0] / tot[1]).item():.4f}")
                    model.save_pretrained(os.path.join(args.save_dir, f"step{step}"))
                torch.save(optim.state_dict(), os.path.join(args.save_dir, f"lamb_rank{rank}.pt"))
                dist.barrier()
            if step >= args.steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""
Logit (+ optional hidden-state) distillation of Llama-3.1-8B into a 300M GPT student.

torchrun --nproc_per_node=8 09_llm_distill_student.py --data /data/fineweb_edu_tok --hidden_weight 0.0
"""
import argparse
import math
import os
import time
from dataclasses import dataclass, asdict

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM


@dataclass
class StudentCfg:
    vocab: int = 128256
    d: int = 1024
    n_layer: int = 20
    n_head: int = 16
    seq: int = 1024
    grad_ckpt: bool = True


class Block(nn.Module):
    def __init__(self, c: StudentCfg):
        super().__init__()
        self.ln1 = nn.LayerNorm(c.d)
        self.qkv = nn.Linear(c.d, 3 * c.d, bias=False)
        self.proj = nn.Linear(c.d, c.d, bias=False)
        self.ln2 = nn.LayerNorm(c.d)
        self.mlp = nn.Sequential(nn.Linear(c.d, 4 * c.d, bias=False), nn.GELU(approximate="tanh"),
                                 nn.Linear(4 * c.d, c.d, bias=False))
        self.n_head = c.n_head

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=-1)
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.mlp(self.ln2(x))


class StudentGPT(nn.Module):
    def __init__(self, c: StudentCfg, teacher_hidden: int):
        super().__init__()
        self.c = c
        self.wte = nn.Embedding(c.vocab, c.d)
        self.wpe = nn.Embedding(c.seq, c.d)
        self.blocks = nn.ModuleList([Block(c) for _ in range(c.n_layer)])
        self.ln_f = nn.LayerNorm(c.d)
        self.lm_head = nn.Linear(c.d, c.vocab, bias=False)
        self.hid_proj = nn.Linear(c.d, teacher_hidden, bias=False)  # for the hidden-state loss
        self.apply(self._init)

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, idx, return_hidden=False):
        pos = torch.arange(idx.size(1), device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for blk in self.blocks:
            if self.c.grad_ckpt and self.training:
                x = checkpoint(blk, x, use_reentrant=True)
            else:
                x = blk(x)
        h = self.ln_f(x)
        return self.lm_head(h), (self.hid_proj(h) if return_hidden else None)


class TokenShards(Dataset):
    def __init__(self, root, seq):
        self.arr = np.memmap(os.path.join(root, "train.bin"), dtype=np.uint32, mode="r")
        self.seq = seq

    def __len__(self):
        return len(self.arr) // self.seq

    def __getitem__(self, i):
        return torch.from_numpy(self.arr[i * self.seq:(i + 1) * self.seq].astype(np.int64))


def distill_loss(s_logits, t_logits, T):
    s = F.log_softmax(s_logits.float() / T, -1)
    t = F.log_softmax(t_logits.float() / T, -1)
    return F.kl_div(s, t, log_target=True, reduction="batchmean") * T * T / s_logits.size(1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--teacher", default="meta-llama/Llama-3.1-8B")
    ap.add_argument("--data", required=True)
    ap.add_argument("--bsz", type=int, default=8)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--steps", type=int, default=50000)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--alpha_ce", type=float, default=0.1)
    ap.add_argument("--hidden_weight", type=float, default=0.0)
    ap.add_argument("--out", default="ckpt/student300m")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    teacher = AutoModelForCausalLM.from_pretrained(args.teacher, torch_dtype=torch.bfloat16).to(dev)
    teacher.eval().requires_grad_(False)

    cfg = StudentCfg()
    student = StudentGPT(cfg, teacher.config.hidden_size).to(dev)
    if rank == 0:
        print(f"student params: {sum(p.numel() for p in student.parameters()) / 1e6:.1f}M", flush=True)
    # hid_proj gets no grad when hidden_weight == 0
    model = DDP(student, device_ids=[local_rank], find_unused_parameters=True)

    ds = TokenShards(args.data, cfg.seq)
    sampler = DistributedSampler(ds, shuffle=True, seed=1234)
    dl = DataLoader(ds, batch_size=args.bsz, sampler=sampler, num_workers=4, pin_memory=True, drop_last=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), fused=True)
    warm = 1000
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps))))

    step, epoch, t0 = 0, 0, time.time()
    model.train()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for idx in dl:
            idx = idx.to(dev, non_blocking=True)
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                t_out = teacher(idx, output_hidden_states=args.hidden_weight > 0)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                s_logits, s_hidden = model(idx, return_hidden=args.hidden_weight > 0)
                kd = distill_loss(s_logits, t_out.logits, args.temperature)
                ce = F.cross_entropy(s_logits[:, :-1].float().reshape(-1, cfg.vocab), idx[:, 1:].reshape(-1))
                loss = kd + args.alpha_ce * ce
                if args.hidden_weight > 0:
                    hid = F.mse_loss(s_hidden.float(), t_out.hidden_states[-1].float())
                    loss = loss + args.hidden_weight * hid
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % 50 == 0:
                logs = torch.stack([kd.detach().float(), ce.detach().float()])
                dist.all_reduce(logs, op=dist.ReduceOp.AVG)
                if rank == 0:
                    tok_s = 50 * args.bsz * cfg.seq * world / (time.time() - t0)
                    print(f"step {step} kd {logs[0]:.4f} ce {logs[1]:.4f} lr {sched.get_last_lr()[0]:.2e} "
                          f"{tok_s / 1e3:.1f}k tok/s", flush=True)
                t0 = time.time()
            if step % 5000 == 0 and rank == 0:
                os.makedirs(args.out, exist_ok=True)
                torch.save({"model": model.module.state_dict(), "cfg": asdict(cfg), "step": step},
                           os.path.join(args.out, f"student_{step}.pt"))
            if step >= args.steps:
                break
        epoch += 1

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

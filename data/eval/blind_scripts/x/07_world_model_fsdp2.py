"""
Action-conditioned world model over discrete frame tokens (IRIS / Genie dynamics style), FSDP2.

Trajectories are pre-tokenized with a frozen VQGAN into 16x16 = 256 tokens per frame and stored as
HDF5 episodes: tokens [T, 256] int16, actions [T] int (discretised).

    torchrun --nnodes 2 --nproc_per_node 8 --rdzv_backend c10d --rdzv_endpoint $HEAD:29500 \
        train_world_model.py --data /data/minecraft_tok --ckpt_dir /ckpt/wm_1b
"""
import argparse
import glob
import math
import os
import time

import h5py
import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader, Dataset, DistributedSampler

import wandb

TOK_PER_FRAME = 256


class EpisodeWindows(Dataset):
    def __init__(self, root, ctx_frames, split="train"):
        self.files = sorted(glob.glob(os.path.join(root, split, "*.h5")))
        self.ctx = ctx_frames
        self.items = []
        for i, f in enumerate(self.files):
            with h5py.File(f, "r") as h:
                T = h["tokens"].shape[0]
            self.items += [(i, s) for s in range(0, T - ctx_frames, ctx_frames // 2)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, idx):
        i, s = self.items[idx]
        with h5py.File(self.files[i], "r") as h:
            tok = torch.from_numpy(h["tokens"][s:s + self.ctx].astype(np.int64))
            act = torch.from_numpy(h["actions"][s:s + self.ctx].astype(np.int64))
        return tok, act


class Block(nn.Module):
    def __init__(self, d, h):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d, bias=False), nn.Linear(d, d, bias=False)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.h = h

    def forward(self, x):
        B, L, D = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, L, 3, self.h, D // self.h).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, L, D))
        return x + self.mlp(self.ln2(x))


class WorldModel(nn.Module):
    def __init__(self, vocab, n_actions, ctx_frames, d=2048, depth=24, heads=16):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab, d)
        self.act_emb = nn.Embedding(n_actions, d)
        self.pos = nn.Parameter(torch.zeros(1, ctx_frames * (TOK_PER_FRAME + 1), d))
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(depth)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        nn.init.normal_(self.pos, std=0.01)

    def forward(self, tokens, actions):
        # sequence per frame: [256 frame tokens, 1 action token]
        B, T, N = tokens.shape
        x = torch.cat([self.tok_emb(tokens), self.act_emb(actions)[:, :, None]], dim=2).flatten(1, 2)
        x = x + self.pos[:, : x.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def lm_loss(logits, tokens):
    # position of token j of frame t+1 is predicted from the position just before it
    B, T, N = tokens.shape
    logits = logits.view(B, T, N + 1, -1)
    pred = torch.cat([logits[:, :-1, N:N + 1], logits[:, 1:, : N - 1]], dim=2)  # [B, T-1, N, V]
    return F.cross_entropy(pred.flatten(0, 2).float(), tokens[:, 1:].flatten())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--ckpt_dir", required=True)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--n_actions", type=int, default=32)
    ap.add_argument("--ctx_frames", type=int, default=8)
    ap.add_argument("--global_batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--ema", type=float, default=0.9999)
    ap.add_argument("--eval_every", type=int, default=2000)
    ap.add_argument("--save_every", type=int, default=5000)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # identical init everywhere; sharding happens below

    with torch.device("cuda"):
        model = WorldModel(args.vocab, args.n_actions, args.ctx_frames)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for blk in model.blocks:
        fully_shard(blk, mp_policy=mp)
    fully_shard(model, mp_policy=mp)

    # EMA kept as DTensors with the same sharding as the live parameters
    ema_params = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, s / args.warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * s / args.steps))))

    step = 0
    latest = os.path.join(args.ckpt_dir, "latest")
    if os.path.exists(latest):
        # DCP reshards on load, so a run resumed on a different number of GPUs is fine
        with open(latest) as f:
            ckpt_path = f.read().strip()
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd, "ema": {str(i): e for i, e in enumerate(ema_params)},
                 "meta": {"step": 0}}
        dcp.load(state, checkpoint_id=ckpt_path)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        step = state["meta"]["step"]
        for _ in range(step):
            sched.step()
        if rank == 0:
            print(f"resumed from {ckpt_path} at step {step}")

    micro = args.global_batch // world
    train = EpisodeWindows(args.data, args.ctx_frames, "train")
    val = EpisodeWindows(args.data, args.ctx_frames, "val")
    tsamp = DistributedSampler(train, shuffle=True, seed=17, drop_last=True)
    vsamp = DistributedSampler(val, shuffle=False, drop_last=True)
    tl = DataLoader(train, batch_size=micro, sampler=tsamp, num_workers=8, pin_memory=True, drop_last=True)
    vl = DataLoader(val, batch_size=micro, sampler=vsamp, num_workers=4, pin_memory=True, drop_last=True)

    if rank == 0:
        wandb.init(project="world-model", name=os.path.basename(args.ckpt_dir), config=vars(args), resume="allow")

    epoch = step // len(tl)
    tsamp.set_epoch(epoch)
    it = iter(tl)
    t0 = time.time()
    while step < args.steps:
        try:
            tok, act = next(it)
        except StopIteration:
            epoch += 1
            tsamp.set_epoch(epoch)
            it = iter(tl)
            tok, act = next(it)
        tok, act = tok.cuda(non_blocking=True), act.cuda(non_blocking=True)
        model.train()
        loss = lm_loss(model(tok, act), tok)
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            torch._foreach_lerp_(ema_params, [p.detach() for p in model.parameters()], 1 - args.ema)
        step += 1

        if step % 10 == 0:
            l = loss.detach()
            dist.all_reduce(l, op=dist.ReduceOp.AVG)
            if rank == 0:
                wandb.log({"train/loss": l.item(), "train/grad_norm": gnorm.full_tensor().item(),
                           "lr": sched.get_last_lr()[0], "time/step": (time.time() - t0) / 10}, step=step)
            t0 = time.time()

        if step % args.eval_every == 0:
            # every rank evaluates its shard of val; the forward of a sharded model needs all ranks anyway
            model.eval()
            tot = torch.zeros(3, device="cuda")
            with torch.no_grad():
                for vt, va in vl:
                    vt, va = vt.cuda(), va.cuda()
                    logits = model(vt, va)
                    n = vt[:, 1:].numel()
                    B, T, N = vt.shape
                    pred = logits.view(B, T, N + 1, -1)
                    pred = torch.cat([pred[:, :-1, N:N + 1], pred[:, 1:, : N - 1]], 2).argmax(-1)
                    tot += torch.stack([lm_loss(logits, vt).float() * n,
                                        (pred == vt[:, 1:]).sum().float(),
                                        torch.tensor(float(n), device="cuda")])
            dist.all_reduce(tot)
            if rank == 0:
                wandb.log({"val/loss": (tot[0] / tot[2]).item(), "val/token_acc": (tot[1] / tot[2]).item()},
                          step=step)

        if step % args.save_every == 0 or step == args.steps:
            path = os.path.join(args.ckpt_dir, f"step_{step:07d}")
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd, "ema": {str(i): e for i, e in enumerate(ema_params)},
                      "meta": {"step": step}}, checkpoint_id=path)
            dist.barrier()
            if rank == 0:
                with open(latest, "w") as f:
                    f.write(path)

    # consolidated EMA export for inference: all ranks take part in the gather, rank 0 writes
    with torch.no_grad():
        for p, e in zip(model.parameters(), ema_params):
            p.copy_(e)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save(full, os.path.join(args.ckpt_dir, "world_model_ema.pt"))
        wandb.finish()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

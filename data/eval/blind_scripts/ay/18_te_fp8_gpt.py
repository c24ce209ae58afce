"""GPT pretraining with TransformerEngine FP8 (delayed scaling, HYBRID e4m3/e5m2) under DDP.

Forward runs inside te.fp8_autocast; amax histories are reduced over the data-parallel group so every
replica uses the same scaling factors.

    torchrun --nproc_per_node=8 18_te_fp8_gpt.py --data /shared/tok/openwebtext --out /shared/runs/te_fp8_1b
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import transformer_engine.pytorch as te
from torch.nn.parallel import DistributedDataParallel as DDP
from transformer_engine.common.recipe import DelayedScaling, Format


class TEGPT(nn.Module):
    def __init__(self, vocab=50304, d=2048, layers=24, heads=16, seq=2048):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.layers = nn.ModuleList(
            te.TransformerLayer(
                hidden_size=d,
                ffn_hidden_size=4 * d,
                num_attention_heads=heads,
                layernorm_epsilon=1e-5,
                hidden_dropout=0.0,
                attention_dropout=0.0,
                self_attn_mask_type="causal",
                layer_number=i + 1,
                attn_input_format="bshd",
                fuse_qkv_params=True,
            )
            for i in range(layers)
        )
        self.norm = te.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        nn.init.normal_(self.embed.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.01)
        nn.init.normal_(self.head.weight, std=0.02)

    def forward(self, idx):
        x = self.embed(idx) + self.pos(torch.arange(idx.size(1), device=idx.device))
        for layer in self.layers:
            x = layer(x)
        # keep the vocab projection out of fp8 (bf16 autocast handles it)
        return self.head(self.norm(x))


def get_batch(data, bs, seq, gen, device):
    ix = torch.randint(len(data) - seq - 1, (bs,), generator=gen)
    buf = torch.from_numpy(np.stack([data[i : i + seq + 1] for i in ix.tolist()]).astype(np.int64))
    buf = buf.pin_memory().to(device, non_blocking=True)
    return buf[:, :-1], buf[:, 1:]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-bs", type=int, default=8)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--steps", type=int, default=30_000)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--warmup", type=int, default=1500)
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--eval-iters", type=int, default=20)
    ap.add_argument("--amax-history", type=int, default=1024)
    ap.add_argument("--no-fp8", action="store_true")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    dp_group = dist.new_group(ranks=list(range(world)))

    train = np.memmap(os.path.join(args.data, "train.bin"), dtype=np.uint16, mode="r")
    val = np.memmap(os.path.join(args.data, "val.bin"), dtype=np.uint16, mode="r")
    gen = torch.Generator().manual_seed(1000 + rank)  # different sample stream per replica
    val_gen = torch.Generator().manual_seed(7 + rank)

    torch.manual_seed(0)
    model = TEGPT(seq=args.seq).to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    ddp = DDP(model, device_ids=[local_rank], bucket_cap_mb=200, gradient_as_bucket_view=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)
    recipe = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=args.amax_history, amax_compute_algo="max")
    use_fp8 = not args.no_fp8

    step = 0
    ck_path = os.path.join(args.out, "ckpt.pt")
    if os.path.exists(ck_path):
        ck = torch.load(ck_path, map_location="cpu", weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        step = ck["step"]
        gen.manual_seed(1000 + rank + step)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{n_params / 1e9:.2f}B params, fp8={use_fp8}, tokens/step={args.micro_bs * args.seq * args.accum * world}",
              flush=True)

    def lr_at(s):
        if s < args.warmup:
            return args.lr * (s + 1) / args.warmup
        return args.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * (s - args.warmup) / (args.steps - args.warmup))))

    @torch.no_grad()
    def evaluate():
        model.eval()
        losses = torch.zeros(args.eval_iters, device=dev)
        for k in range(args.eval_iters):
            x, y = get_batch(val, args.micro_bs, args.seq, val_gen, dev)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(x)
            losses[k] = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))
        m = losses.mean()
        dist.all_reduce(m, op=dist.ReduceOp.AVG)
        model.train()
        return m.item()

    flops_per_token = 6 * n_params + 12 * 24 * 2048 * args.seq
    ev_start, ev_end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ev_start.record()
    while step < args.steps:
        for g in opt.param_groups:
            g["lr"] = lr_at(step)
        loss_acc = torch.zeros((), device=dev)
        for micro in range(args.accum):
            x, y = get_batch(train, args.micro_bs, args.seq, gen, dev)
            sync = micro == args.accum - 1
            ddp.require_backward_grad_sync = sync
            with torch.autocast("cuda", dtype=torch.bfloat16):
                with te.fp8_autocast(enabled=use_fp8, fp8_recipe=recipe, fp8_group=dp_group):
                    logits = ddp(x)
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1)) / args.accum
            loss.backward()
            loss_acc += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1

        if step % 10 == 0:
            ev_end.record()
            ev_end.synchronize()
            sec = ev_start.elapsed_time(ev_end) / 1000 / 10
            dist.all_reduce(loss_acc, op=dist.ReduceOp.AVG)
            if rank == 0:
                tok_s = args.micro_bs * args.seq * args.accum * world / sec
                mfu = tok_s * flops_per_token / (world * 989e12)
                print(f"step {step} loss {loss_acc.item():.4f} lr {lr_at(step):.2e} "
                      f"{tok_s / 1e6:.2f}M tok/s MFU(bf16 peak) {mfu:.1%}", flush=True)
            ev_start.record()

        if step % args.eval_every == 0:
            vl = evaluate()
            if rank == 0:
                print(f"step {step} val {vl:.4f}", flush=True)
                torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step}, ck_path + ".tmp")
                os.replace(ck_path + ".tmp", ck_path)
            dist.barrier()
            ev_start.record()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()

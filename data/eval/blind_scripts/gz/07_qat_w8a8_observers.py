"""W8A8 quantization-aware training with EMA range observers.

Activations use per-tensor asymmetric int8 with ranges tracked by an EMA
observer for the first `--observe_steps` updates, then frozen; weights use
per-output-channel symmetric int8. Trained with DDP on packed text.

torchrun --nproc_per_node=8 07_qat_w8a8_observers.py --train_files "data/fineweb_edu/*.jsonl"
"""
import argparse
import glob
import itertools
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup


class ActFakeQuant(nn.Module):
    def __init__(self, bits=8, momentum=0.01):
        super().__init__()
        self.qmax = 2 ** bits - 1
        self.momentum = momentum
        self.observing = True
        self.register_buffer("lo", torch.tensor(0.0))
        self.register_buffer("hi", torch.tensor(0.0))
        self.register_buffer("initialized", torch.tensor(False))

    def forward(self, x):
        if self.training and self.observing:
            with torch.no_grad():
                lo, hi = x.detach().min().float(), x.detach().max().float()
                if not bool(self.initialized):
                    self.lo.copy_(lo)
                    self.hi.copy_(hi)
                    self.initialized.fill_(True)
                else:
                    self.lo.lerp_(lo, self.momentum)
                    self.hi.lerp_(hi, self.momentum)
        scale = ((self.hi - self.lo) / self.qmax).clamp(min=1e-8)
        zp = torch.round(-self.lo / scale)
        xq = (torch.clamp(torch.round(x / scale) + zp, 0, self.qmax) - zp) * scale
        return x + (xq - x).detach()


class QLinear(nn.Linear):
    def __init__(self, lin, w_bits=8, a_bits=8):
        super().__init__(lin.in_features, lin.out_features, bias=lin.bias is not None,
                         device=lin.weight.device, dtype=lin.weight.dtype)
        self.weight = lin.weight
        self.bias = lin.bias
        self.w_qmax = 2 ** (w_bits - 1) - 1
        self.act_q = ActFakeQuant(a_bits)

    def forward(self, x):
        w = self.weight
        s = w.detach().abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / self.w_qmax
        wq = torch.clamp(torch.round(w / s), -self.w_qmax - 1, self.w_qmax) * s
        w = w + (wq - w).detach()
        return F.linear(self.act_q(x), w, self.bias)


class QATModel(nn.Module):
    def __init__(self, base, skip=("lm_head",)):
        super().__init__()
        self.base = base
        for name, mod in list(base.named_modules()):
            for cname, child in list(mod.named_children()):
                full = f"{name}.{cname}" if name else cname
                if isinstance(child, nn.Linear) and not any(full.endswith(s) for s in skip):
                    setattr(mod, cname, QLinear(child))

    def forward(self, **kw):
        return self.base(**kw)

    def act_quantizers(self):
        return [m for m in self.modules() if isinstance(m, ActFakeQuant)]

    def freeze_observers(self):
        for q in self.act_quantizers():
            q.observing = False

    def range_summary(self):
        qs = self.act_quantizers()
        widths = torch.stack([q.hi - q.lo for q in qs])
        return len(qs), widths.mean().item(), widths.max().item()


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="Qwen/Qwen2.5-1.5B")
    ap.add_argument("--train_files", default="data/fineweb_edu/*.jsonl")
    ap.add_argument("--block", type=int, default=2048)
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--observe_steps", type=int, default=300)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--eval_every", type=int, default=500)
    ap.add_argument("--n_val_blocks", type=int, default=400)
    ap.add_argument("--out", default="ckpt/qwen2.5-1.5b-w8a8-qat")
    ap.add_argument("--seed", type=int, default=3)
    return ap.parse_args()


def packed_dataset(tok, pattern, block, seed):
    ds = load_dataset("json", data_files=sorted(glob.glob(pattern)), split="train")
    ds = ds.map(lambda b: tok(b["text"]), batched=True, remove_columns=ds.column_names, num_proc=16)

    def pack(b):
        ids = list(itertools.chain.from_iterable(x + [tok.eos_token_id] for x in b["input_ids"]))
        n = len(ids) // block * block
        return {"input_ids": [ids[i:i + block] for i in range(0, n, block)]}

    ds = ds.map(pack, batched=True, remove_columns=ds.column_names, num_proc=16)
    ds = ds.shuffle(seed=seed)
    ds.set_format("torch")
    return ds


@torch.no_grad()
def val_loss(model, loader, device):
    model.eval()
    t = torch.zeros(2, device=device)
    for b in loader:
        ids = b["input_ids"].to(device)
        t[0] += model(input_ids=ids, labels=ids).loss * ids.size(0)
        t[1] += ids.size(0)
    dist.all_reduce(t)
    model.train()
    return (t[0] / t[1]).item()


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    if rank != 0:
        dist.barrier()
    ds = packed_dataset(tok, args.train_files, args.block, args.seed)
    if rank == 0:
        dist.barrier()
    val_ds = Subset(ds, range(args.n_val_blocks))
    train_ds = Subset(ds, range(args.n_val_blocks, len(ds)))

    base = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    model = QATModel(base).to(device)
    model = DDP(model, device_ids=[local_rank])

    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=4, pin_memory=True)
    val_loader = DataLoader(Subset(val_ds, range(rank, len(val_ds), world)), batch_size=args.bs)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.05},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr)
    sched = get_cosine_schedule_with_warmup(opt, args.warmup, args.steps)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        n_q, _, _ = model.module.range_summary()
        print(f"{n_q} activation quantizers, {len(train_ds)} train blocks, world {world}", flush=True)

    step, epoch = 0, 0
    tic = time.time()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for b in loader:
            ids = b["input_ids"].to(device, non_blocking=True)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step == args.observe_steps:
                model.freeze_observers()
                if rank == 0:
                    n_q, mean_w, max_w = model.module.range_summary()
                    print(f"froze {n_q} observers: mean range {mean_w:.3f} max {max_w:.3f}", flush=True)

            if step % 25 == 0:
                l = loss.detach().float()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step} loss {l.item():.4f} lr {sched.get_last_lr()[0]:.2e} "
                          f"{(time.time() - tic) / 25:.2f}s/step", flush=True)
                tic = time.time()

            if step % args.eval_every == 0 or step == args.steps:
                vl = val_loss(model.module, val_loader, device)
                if rank == 0:
                    print(f"[val] step {step} loss {vl:.4f} ppl {math.exp(vl):.2f}", flush=True)
                    torch.save({"model": model.module.state_dict(), "step": step,
                                "observers_frozen": step >= args.observe_steps},
                               os.path.join(args.out, "qat_state.pt"))
                dist.barrier()
            if step >= args.steps:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()

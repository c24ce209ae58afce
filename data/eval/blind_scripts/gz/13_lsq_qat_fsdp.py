"""LSQ quantization-aware training (W4A8) of Qwen2.5-1.5B with FSDP.

Weight step sizes are per output channel, activation step sizes per tensor,
both learned (Esser et al., LSQ). Activation steps are initialised from a
calibration batch on every rank and averaged before wrapping. Resumable
sharded checkpoints go through torch.distributed.checkpoint; the final model is
exported as one consolidated state dict.

    torchrun --nproc_per_node=8 13_lsq_qat_fsdp.py --data data/qwen_tok_4k --out runs/lsq-w4a8
"""
import argparse
import functools
import json
import math
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F
from datasets import load_from_disk
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import FullStateDictConfig, MixedPrecision, StateDictType
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy
from torch.utils.data import DataLoader, DistributedSampler, Subset
from transformers import AutoModelForCausalLM
from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer


def grad_scale(x, s):
    return (x - x * s).detach() + x * s


def round_ste(x):
    return (x.round() - x).detach() + x


class LSQLinear(nn.Linear):
    def __init__(self, lin, w_bits=4, a_bits=8):
        super().__init__(lin.in_features, lin.out_features, bias=lin.bias is not None)
        self.weight = lin.weight
        self.bias = lin.bias
        self.wq_n, self.wq_p = 2 ** (w_bits - 1), 2 ** (w_bits - 1) - 1
        self.aq_n, self.aq_p = 2 ** (a_bits - 1), 2 ** (a_bits - 1) - 1
        w = lin.weight.detach()
        self.w_step = nn.Parameter(2 * w.abs().mean(dim=1, keepdim=True) / math.sqrt(self.wq_p))
        self.a_step = nn.Parameter(torch.ones(1))
        self.calibrating = False
        self.calib_value = None

    def forward(self, x):
        if self.calibrating:
            self.calib_value = (2 * x.detach().abs().mean() / math.sqrt(self.aq_p)).float()
        gw = 1.0 / math.sqrt(self.weight.numel() * self.wq_p)
        sw = grad_scale(self.w_step, gw)
        w = round_ste(torch.clamp(self.weight / sw, -self.wq_n, self.wq_p)) * sw
        ga = 1.0 / math.sqrt(x[..., 0].numel() * self.aq_p)
        sa = grad_scale(self.a_step, ga)
        x = round_ste(torch.clamp(x / sa, -self.aq_n, self.aq_p)) * sa
        return F.linear(x, w, self.bias)


def quantize_model(model, w_bits, a_bits):
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, LSQLinear(child, w_bits, a_bits))


@torch.no_grad()
def init_act_steps(model, batch, device):
    qs = [m for m in model.modules() if isinstance(m, LSQLinear)]
    for q in qs:
        q.calibrating = True
    model(input_ids=batch.to(device))
    vals = torch.stack([q.calib_value for q in qs]).unsqueeze(1)
    dist.all_reduce(vals, op=dist.ReduceOp.AVG)  # identical init on all ranks
    for q, v in zip(qs, vals):
        q.a_step.copy_(v)
        q.calibrating = False
        q.calib_value = None
    return len(qs)


def cli():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="Qwen/Qwen2.5-1.5B")
    p.add_argument("--data", default="data/qwen_tok_4k")
    p.add_argument("--out", default="runs/lsq-w4a8")
    p.add_argument("--w_bits", type=int, default=4)
    p.add_argument("--a_bits", type=int, default=8)
    p.add_argument("--bs", type=int, default=2)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--step_lr", type=float, default=1e-4)
    p.add_argument("--steps", type=int, default=5000)
    p.add_argument("--ckpt_every", type=int, default=500)
    p.add_argument("--n_val", type=int, default=256)
    return p.parse_args()


def main():
    args = cli()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    ds = load_from_disk(args.data).with_format("torch")
    val_ds, train_ds = Subset(ds, range(args.n_val)), Subset(ds, range(args.n_val, len(ds)))
    sampler = DistributedSampler(train_ds, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=4, pin_memory=True)
    # FSDP needs the same number of forwards on every rank, so each rank gets an equal slice
    per_rank = args.n_val // world
    val_loader = DataLoader(Subset(val_ds, range(rank * per_rank, (rank + 1) * per_rank)), batch_size=args.bs)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    quantize_model(model, args.w_bits, args.a_bits)
    model.to(device)
    n_q = init_act_steps(model, next(iter(loader))["input_ids"], device)

    policy = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Qwen2DecoderLayer})
    model = FSDP(model, auto_wrap_policy=policy, device_id=device, use_orig_params=True,
                 sync_module_states=True,
                 mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))

    steps = [p for n, p in model.named_parameters() if n.endswith("_step")]
    others = [p for n, p in model.named_parameters() if not n.endswith("_step")]
    opt = torch.optim.AdamW([{"params": others, "lr": args.lr, "weight_decay": 0.0},
                             {"params": steps, "lr": args.step_lr, "weight_decay": 0.0}])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))

    start = 0
    meta_path = os.path.join(args.out, "latest.json")
    if os.path.exists(meta_path):
        with open(meta_path) as f:
            meta = json.load(f)
        model_sd, optim_sd = get_state_dict(model, opt)
        state = {"model": model_sd, "optim": optim_sd}
        dcp.load(state, checkpoint_id=meta["path"])
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = meta["step"]
        for _ in range(start):
            sched.step()
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{n_q} LSQ linears, start at step {start}, world {world}", flush=True)

    step, epoch = start, start // max(1, len(loader))
    t0 = time.time()
    model.train()
    while step < args.steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            ids = batch["input_ids"].to(device, non_blocking=True)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % 20 == 0:
                l = loss.detach().float()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step} loss {l.item():.4f} {(time.time() - t0) / 20:.2f}s/step", flush=True)
                t0 = time.time()

            if step % args.ckpt_every == 0:
                path = os.path.join(args.out, f"dcp_step{step}")
                model_sd, optim_sd = get_state_dict(model, opt)
                dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
                if rank == 0:
                    with open(meta_path + ".tmp", "w") as f:
                        json.dump({"step": step, "path": path}, f)
                    os.replace(meta_path + ".tmp", meta_path)
                dist.barrier()
            if step >= args.steps:
                break
        epoch += 1

    # validation on the rank's own slice, summed over ranks
    model.eval()
    tot = torch.zeros(2, device=device, dtype=torch.float64)
    with torch.no_grad():
        for batch in val_loader:
            ids = batch["input_ids"].to(device)
            tot[0] += model(input_ids=ids, labels=ids).loss.double() * ids.size(0)
            tot[1] += ids.size(0)
    dist.all_reduce(tot)

    # consolidated export: every rank takes part in the gather, only rank 0 holds and writes it
    cfg = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, cfg):
        full = model.state_dict()
    if rank == 0:
        print(f"final val loss {(tot[0] / tot[1]).item():.4f}", flush=True)
        torch.save(full, os.path.join(args.out, "lsq_w4a8_final.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

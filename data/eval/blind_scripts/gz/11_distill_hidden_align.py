"""Layer-aligned distillation (logits + intermediate hidden states).

Student: a freshly initialised 12-layer, 1024-wide GPT-NeoX (half the depth
and width of Pythia-1.4B); a learned projector maps its hidden states to the
teacher width.
Hidden-state alignment is only computed every `--hidden_every` steps because
the teacher hidden states of all layers are large; the logit KD runs every step.

  torchrun --nproc_per_node=8 11_distill_hidden_align.py --config cfg/pythia_kd.json
"""
import argparse
import json
import math
import os
import time
from dataclasses import dataclass, asdict

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from datasets import load_from_disk
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForCausalLM, GPTNeoXConfig, GPTNeoXForCausalLM


@dataclass
class Config:
    teacher: str = "EleutherAI/pythia-1.4b"
    data_path: str = "data/pile_dedup_2048_tok"
    out_dir: str = "runs/pythia-kd-12L"
    student_layers: int = 12
    student_hidden: int = 1024
    seq_len: int = 2048
    micro_bs: int = 8
    lr: float = 3e-4
    min_lr: float = 3e-5
    warmup: int = 1000
    max_steps: int = 30000
    temperature: float = 1.0
    w_kd: float = 1.0
    w_ce: float = 0.5
    w_hidden: float = 0.1
    hidden_every: int = 4
    log_every: int = 20
    ckpt_every: int = 2000
    seed: int = 1337


class Student(nn.Module):
    def __init__(self, cfg: Config, teacher_cfg):
        super().__init__()
        scfg = GPTNeoXConfig(**{**teacher_cfg.to_dict(), "num_hidden_layers": cfg.student_layers,
                                "hidden_size": cfg.student_hidden,
                                "intermediate_size": 4 * cfg.student_hidden,
                                "num_attention_heads": cfg.student_hidden // 128})
        self.lm = GPTNeoXForCausalLM(scfg)
        # maps student hidden states to the teacher width for the alignment loss
        self.proj = nn.Linear(cfg.student_hidden, teacher_cfg.hidden_size, bias=False)

    def forward(self, input_ids, want_hidden=False):
        out = self.lm(input_ids=input_ids, output_hidden_states=want_hidden)
        hidden = None
        if want_hidden:
            hidden = [self.proj(h) for h in out.hidden_states[1:]]
        return out.logits, hidden


def lr_at(step, cfg):
    if step < cfg.warmup:
        return cfg.lr * step / cfg.warmup
    prog = min(1.0, (step - cfg.warmup) / (cfg.max_steps - cfg.warmup))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * prog))


def kd_terms(s_logits, t_logits, ids, T):
    s = s_logits[:, :-1].float()
    t = t_logits[:, :-1].float()
    kd = F.kl_div(F.log_softmax(s / T, -1).flatten(0, 1), F.log_softmax(t / T, -1).flatten(0, 1),
                  log_target=True, reduction="batchmean") * T * T
    ce = F.cross_entropy(s.flatten(0, 1), ids[:, 1:].flatten())
    return kd, ce


def hidden_loss(s_hidden, t_hidden):
    # student layer i is matched to teacher layer 2i+1
    losses = []
    for i, h in enumerate(s_hidden):
        th = t_hidden[2 * i + 2]
        losses.append(F.mse_loss(F.layer_norm(h.float(), h.shape[-1:]), F.layer_norm(th.float(), th.shape[-1:])))
    return torch.stack(losses).mean()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    cli = ap.parse_args()
    cfg = Config()
    if cli.config:
        with open(cli.config) as f:
            cfg = Config(**{**asdict(cfg), **json.load(f)})

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed)

    teacher = AutoModelForCausalLM.from_pretrained(cfg.teacher, torch_dtype=torch.bfloat16).to(dev).eval()
    teacher.requires_grad_(False)
    student = Student(cfg, teacher.config).to(dev)
    model = DDP(student, device_ids=[local_rank])

    ds = load_from_disk(cfg.data_path).with_format("torch")
    sampler = DistributedSampler(ds, shuffle=True, seed=cfg.seed, drop_last=True)
    loader = DataLoader(ds, batch_size=cfg.micro_bs, sampler=sampler, num_workers=4,
                        pin_memory=True, drop_last=True, persistent_workers=True)

    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.1, fused=True)

    step, epoch = 0, 0
    ckpt_path = os.path.join(cfg.out_dir, "last.pt")
    if os.path.exists(ckpt_path):
        ck = torch.load(ckpt_path, map_location="cpu")
        model.module.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        step, epoch = ck["step"], ck["epoch"]
    if rank == 0:
        os.makedirs(cfg.out_dir, exist_ok=True)
        n = sum(p.numel() for p in student.parameters())
        print(f"student {n / 1e6:.0f}M params, resume at step {step}", flush=True)

    t0 = time.time()
    model.train()
    while step < cfg.max_steps:
        sampler.set_epoch(epoch)
        for batch in loader:
            ids = batch["input_ids"].to(dev, non_blocking=True)
            want_hidden = step % cfg.hidden_every == 0
            for g in opt.param_groups:
                g["lr"] = lr_at(step, cfg)

            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                t_out = teacher(input_ids=ids, output_hidden_states=want_hidden)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                s_logits, s_hidden = model(ids, want_hidden=want_hidden)
                kd, ce = kd_terms(s_logits, t_out.logits, ids, cfg.temperature)
                loss = cfg.w_kd * kd + cfg.w_ce * ce
                if want_hidden:
                    hl = hidden_loss(s_hidden, t_out.hidden_states)
                    loss = loss + cfg.w_hidden * hl

            opt.zero_grad(set_to_none=True)
            loss.backward()
            gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            step += 1

            if step % cfg.log_every == 0:
                stats = torch.stack([loss.detach(), kd.detach(), ce.detach()]).float()
                dist.all_reduce(stats, op=dist.ReduceOp.AVG)
                if rank == 0:
                    dt = (time.time() - t0) / cfg.log_every
                    print(f"step {step} loss {stats[0]:.4f} kd {stats[1]:.4f} ce {stats[2]:.4f} "
                          f"gnorm {gnorm:.2f} lr {lr_at(step, cfg):.2e} {dt:.2f}s/it", flush=True)
                t0 = time.time()

            if step % cfg.ckpt_every == 0 and rank == 0:
                torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(),
                            "step": step, "epoch": epoch, "cfg": asdict(cfg)}, ckpt_path + ".tmp")
                os.replace(ckpt_path + ".tmp", ckpt_path)
            if step >= cfg.max_steps:
                break
        epoch += 1

    if rank == 0:
        model.module.lm.save_pretrained(os.path.join(cfg.out_dir, "final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

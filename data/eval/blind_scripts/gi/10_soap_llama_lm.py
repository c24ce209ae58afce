"""
SOAP (Shampoo with Adam in the preconditioner's eigenbasis) for a 350M decoder LM.

The eigendecompositions are the expensive part, so they are distributed:
every `precondition_frequency` steps rank (i % world) refreshes the eigenbases
of matrix i and broadcasts them. Between refreshes all ranks just run Adam in
the rotated space, which is cheap.

  torchrun --nproc_per_node=8 10_soap_llama_lm.py --config configs/lm350m.yaml
"""
import argparse
import math
import os
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
import wandb
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from transformers import LlamaConfig, LlamaForCausalLM


class DistSOAP(torch.optim.Optimizer):
    def __init__(self, params, lr=3e-3, betas=(0.95, 0.95), shampoo_beta=0.95, eps=1e-8,
                 weight_decay=0.01, precondition_frequency=10):
        super().__init__(params, dict(lr=lr, betas=betas, shampoo_beta=shampoo_beta, eps=eps,
                                      weight_decay=weight_decay))
        self.freq = precondition_frequency
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self._step = 0

    @staticmethod
    def _eigbasis(mat):
        mat = mat.float() + 1e-30 * torch.eye(mat.size(0), device=mat.device)
        _, q = torch.linalg.eigh(mat)
        return torch.flip(q, [1])

    def _refresh(self):
        i = 0
        for group in self.param_groups:
            for p in group["params"]:
                st = self.state[p]
                owner = i % self.world
                if owner == self.rank:
                    st["QL"].copy_(self._eigbasis(st["GL"]))
                    st["QR"].copy_(self._eigbasis(st["GR"]))
                dist.broadcast(st["QL"], src=owner)
                dist.broadcast(st["QR"], src=owner)
                i += 1

    @torch.no_grad()
    def step(self):
        self._step += 1
        for group in self.param_groups:
            b1, b2 = group["betas"]
            sb = group["shampoo_beta"]
            for p in group["params"]:
                g = p.grad.float()
                st = self.state[p]
                if not st:
                    m, n = p.shape
                    st["GL"] = torch.zeros(m, m, device=p.device)
                    st["GR"] = torch.zeros(n, n, device=p.device)
                    st["QL"] = torch.eye(m, device=p.device)
                    st["QR"] = torch.eye(n, device=p.device)
                    st["exp_avg"] = torch.zeros_like(g)
                    st["exp_avg_sq"] = torch.zeros_like(g)
                st["GL"].lerp_(g @ g.T, 1 - sb)
                st["GR"].lerp_(g.T @ g, 1 - sb)
                if self._step == 1:
                    continue  # first step only collects statistics
                g_rot = st["QL"].T @ g @ st["QR"]
                st["exp_avg"].mul_(b1).add_(g, alpha=1 - b1)
                st["exp_avg_sq"].mul_(b2).addcmul_(g_rot, g_rot, value=1 - b2)
                m_rot = st["QL"].T @ st["exp_avg"] @ st["QR"]
                t = self._step - 1
                step_size = group["lr"] * math.sqrt(1 - b2 ** t) / (1 - b1 ** t)
                upd = st["QL"] @ (m_rot / (st["exp_avg_sq"].sqrt() + group["eps"])) @ st["QR"].T
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(upd.to(p.dtype), alpha=-step_size)
        if self._step == 1 or self._step % self.freq == 0:
            self._refresh()


def get_batch(data, batch_size, seq_len, device, gen):
    ix = torch.randint(len(data) - seq_len - 1, (batch_size,), generator=gen)
    x = torch.stack([torch.from_numpy(data[i:i + seq_len].astype(np.int64)) for i in ix.tolist()])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + seq_len].astype(np.int64)) for i in ix.tolist()])
    return x.to(device, non_blocking=True), y.to(device, non_blocking=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--run_name", default=None)
    args = ap.parse_args()
    with open(args.config) as f:
        cfg = yaml.safe_load(f)

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    is_main = rank == 0

    wandb.init(project=cfg.get("wandb_project", "soap-lm"), name=args.run_name, config=cfg)

    torch.manual_seed(cfg["seed"])
    mcfg = LlamaConfig(vocab_size=cfg["vocab_size"], hidden_size=cfg["d_model"], intermediate_size=cfg["d_ff"],
                       num_hidden_layers=cfg["n_layers"], num_attention_heads=cfg["n_heads"],
                       max_position_embeddings=cfg["seq_len"], tie_word_embeddings=False)
    model = LlamaForCausalLM(mcfg).to(device)
    model = DDP(model, device_ids=[local_rank])

    soap_params = [p for n, p in model.module.model.layers.named_parameters() if p.ndim == 2]
    soap_ids = {id(p) for p in soap_params}
    rest = [p for p in model.module.parameters() if id(p) not in soap_ids]
    soap = DistSOAP(soap_params, lr=cfg["lr"], precondition_frequency=cfg.get("precond_freq", 10))
    adamw = torch.optim.AdamW(rest, lr=cfg["lr"], betas=(0.9, 0.95), weight_decay=0.0)
    opts = [soap, adamw]

    train = np.memmap(cfg["train_bin"], dtype=np.uint16, mode="r")
    val = np.memmap(cfg["val_bin"], dtype=np.uint16, mode="r")
    gen = torch.Generator().manual_seed(cfg["seed"] + rank)
    val_gen = torch.Generator().manual_seed(1234 + rank)
    B, T = cfg["micro_batch"], cfg["seq_len"]
    total, warmup = cfg["steps"], cfg["warmup"]
    ckpt_dir = cfg["ckpt_dir"]
    if is_main:
        os.makedirs(ckpt_dir, exist_ok=True)

    t0 = time.time()
    for step in range(1, total + 1):
        frac = step / warmup if step < warmup else 0.5 * (1 + math.cos(math.pi * (step - warmup) / (total - warmup)))
        for o in opts:
            for g in o.param_groups:
                g["lr"] = cfg["lr"] * frac
        x, y = get_batch(train, B, T, device, gen)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(input_ids=x).logits
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.view(-1))
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for o in opts:
            o.step()
            o.zero_grad(set_to_none=True)

        if step % 10 == 0:
            dt = (time.time() - t0) / 10
            t0 = time.time()
            wandb.log({"train/loss": loss.item(), "train/grad_norm": gnorm.item(),
                       "train/lr": cfg["lr"] * frac, "perf/step_time": dt,
                       "perf/tok_per_s": B * T * world / dt}, step=step)
            if is_main:
                print(f"step {step} loss {loss.item():.4f} gnorm {gnorm.item():.2f} {dt * 1000:.0f}ms")

        if step % cfg["eval_every"] == 0:
            model.eval()
            vl = torch.zeros((), device=device)
            with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
                for _ in range(cfg["eval_iters"]):
                    vx, vy = get_batch(val, B, T, device, val_gen)
                    vlog = model(input_ids=vx).logits
                    vl += F.cross_entropy(vlog.float().view(-1, vlog.size(-1)), vy.view(-1))
            vl /= cfg["eval_iters"]
            dist.all_reduce(vl, op=dist.ReduceOp.AVG)
            model.train()
            wandb.log({"val/loss": vl.item(), "val/ppl": math.exp(vl.item())}, step=step)
            if is_main:
                torch.save({"model": model.module.state_dict(), "step": step, "cfg": cfg},
                           os.path.join(ckpt_dir, "latest.pt"))
            dist.barrier()

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

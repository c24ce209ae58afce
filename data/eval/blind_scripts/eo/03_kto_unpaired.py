"""KTO (Kahneman-Tversky Optimization) on unpaired thumbs-up / thumbs-down feedback.

Each jsonl row: {"prompt": str, "completion": str, "label": true|false}

    torchrun --nproc_per_node=8 03_kto_unpaired.py --config configs/kto_tinyllama.yaml
"""
import argparse
import json
import os
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_constant_schedule_with_warmup

IGNORE = -100


@dataclass
class KTOConfig:
    model: str = "ckpts/sft-tinyllama-1.1b"
    train_file: str = "data/feedback_train.jsonl"
    output_dir: str = "runs/kto"
    beta: float = 0.1
    desirable_weight: float = 1.0
    undesirable_weight: float = 1.0
    lr: float = 5e-7
    warmup_steps: int = 50
    batch_size: int = 4
    epochs: int = 3
    max_length: int = 1024
    max_prompt_length: int = 512
    save_every: int = 500
    seed: int = 3
    tags: list = field(default_factory=list)


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ns = ap.parse_args()
    with open(ns.config) as f:
        return KTOConfig(**yaml.safe_load(f))


class FeedbackDataset(Dataset):
    def __init__(self, path, tok, cfg):
        with open(path) as f:
            self.rows = [json.loads(l) for l in f if l.strip()]
        self.tok = tok
        self.cfg = cfg

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        r = self.rows[i]
        p = self.tok(r["prompt"], add_special_tokens=False)["input_ids"][-self.cfg.max_prompt_length:]
        c = self.tok(r["completion"], add_special_tokens=False)["input_ids"] + [self.tok.eos_token_id]
        return {"prompt": p, "completion": c, "label": bool(r["label"])}


class KTOCollator:
    def __init__(self, pad_id, max_length):
        self.pad_id = pad_id
        self.max_length = max_length

    def _pack(self, prompt, completion):
        ids = (prompt + completion)[: self.max_length]
        labels = ([IGNORE] * len(prompt) + completion)[: self.max_length]
        return ids, labels

    def __call__(self, items):
        seqs, labs = [], []
        for it in items:
            s, l = self._pack(it["prompt"], it["completion"])
            seqs.append(s)
            labs.append(l)
        # KL reference sequences: each prompt paired with the next example's completion
        n = len(items)
        for j, it in enumerate(items):
            s, l = self._pack(it["prompt"], items[(j + 1) % n]["completion"])
            seqs.append(s)
            labs.append(l)
        T = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), T), self.pad_id, dtype=torch.long)
        labels = torch.full((len(seqs), T), IGNORE, dtype=torch.long)
        mask = torch.zeros((len(seqs), T), dtype=torch.long)
        for k, (s, l) in enumerate(zip(seqs, labs)):
            ids[k, : len(s)] = torch.tensor(s)
            labels[k, : len(l)] = torch.tensor(l)
            mask[k, : len(s)] = 1
        desirable = torch.tensor([it["label"] for it in items], dtype=torch.bool)
        return {"input_ids": ids, "attention_mask": mask, "labels": labels, "desirable": desirable}


def seq_logps(model, batch):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    logits = logits[:, :-1].float()
    labels = batch["labels"][:, 1:].clone()
    m = labels != IGNORE
    labels[~m] = 0
    tok_lp = logits.log_softmax(-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return (tok_lp * m).sum(-1)


def kto_loss(pol, ref, desirable, cfg, world):
    n = desirable.numel()
    pol_t, pol_kl = pol[:n], pol[n:]
    ref_t, ref_kl = ref[:n], ref[n:]

    # batch-level KL estimate, averaged over all ranks and treated as a constant
    kl = (pol_kl - ref_kl).mean().detach()
    dist.all_reduce(kl)
    kl = (kl / world).clamp(min=0)

    logratio = pol_t - ref_t
    pos = 1 - torch.sigmoid(cfg.beta * (logratio[desirable] - kl))
    neg = 1 - torch.sigmoid(cfg.beta * (kl - logratio[~desirable]))
    losses = torch.cat([cfg.desirable_weight * pos, cfg.undesirable_weight * neg])
    rewards = cfg.beta * logratio.detach()
    return losses.mean(), rewards, kl


def main():
    cfg = load_config()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed)

    tok = AutoTokenizer.from_pretrained(cfg.model)
    tok.pad_token = tok.pad_token or tok.unk_token or tok.eos_token

    ds = FeedbackDataset(cfg.train_file, tok, cfg)
    sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=True, seed=cfg.seed, drop_last=True)
    loader = DataLoader(ds, batch_size=cfg.batch_size, sampler=sampler, num_workers=4,
                        collate_fn=KTOCollator(tok.pad_token_id, cfg.max_length), drop_last=True)

    policy = AutoModelForCausalLM.from_pretrained(cfg.model, torch_dtype=torch.float32)
    policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy.config.use_cache = False
    policy.to(dev)
    ref = AutoModelForCausalLM.from_pretrained(cfg.model, torch_dtype=torch.bfloat16).to(dev)
    ref.eval().requires_grad_(False)
    model = DDP(policy, device_ids=[local_rank])

    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    sched = get_constant_schedule_with_warmup(opt, cfg.warmup_steps)
    if rank == 0:
        os.makedirs(cfg.output_dir, exist_ok=True)
        n_pos = sum(r["label"] for r in ds.rows)
        print(f"examples={len(ds)} desirable={n_pos} undesirable={len(ds) - n_pos} world={world}", flush=True)

    step = 0
    t0 = time.time()
    for epoch in range(cfg.epochs):
        for batch in loader:
            batch = {k: v.to(dev, non_blocking=True) for k, v in batch.items()}
            pol = seq_logps(model, batch)
            with torch.no_grad():
                ref_lp = seq_logps(ref, batch)
            loss, rewards, kl = kto_loss(pol, ref_lp, batch["desirable"], cfg, world)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % 10 == 0:
                d = batch["desirable"]
                stats = torch.stack([
                    loss.detach(),
                    rewards[d].sum(), d.sum().float(),
                    rewards[~d].sum(), (~d).sum().float(),
                ])
                dist.all_reduce(stats)
                if rank == 0:
                    print(f"ep {epoch} step {step} loss {stats[0].item() / world:.4f} kl {kl.item():.4f} "
                          f"r+ {(stats[1] / stats[2].clamp(min=1)).item():.3f} "
                          f"r- {(stats[3] / stats[4].clamp(min=1)).item():.3f} "
                          f"lr {sched.get_last_lr()[0]:.2e} t {time.time() - t0:.0f}s", flush=True)

            if step % cfg.save_every == 0:
                if rank == 0:
                    path = os.path.join(cfg.output_dir, f"step-{step}")
                    model.module.save_pretrained(path, safe_serialization=True)
                    tok.save_pretrained(path)
                dist.barrier()

    if rank == 0:
        model.module.save_pretrained(os.path.join(cfg.output_dir, "final"))
        tok.save_pretrained(os.path.join(cfg.output_dir, "final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

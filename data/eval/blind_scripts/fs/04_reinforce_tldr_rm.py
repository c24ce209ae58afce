"""REINFORCE with a moving-average baseline for TL;DR summarisation.

Rewards come from a DeBERTa reward model; the baseline is an EMA of the global
(all-rank) mean reward. Sequence-level KL penalty against the SFT model.

Run:  torchrun --standalone --nproc_per_node=4 04_reinforce_tldr_rm.py --config configs/tldr_reinforce.yaml
"""
import argparse
import logging
import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import yaml
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer,
                          get_linear_schedule_with_warmup)

logger = logging.getLogger("reinforce")


@dataclass
class Config:
    sft_model: str = "cleanrl/EleutherAI_pythia-1b-deduped__sft__tldr"
    reward_model: str = "OpenAssistant/reward-model-deberta-v3-large-v2"
    dataset: str = "trl-lib/tldr"
    out_dir: str = "outputs/reinforce_tldr"
    batch_size: int = 16
    max_prompt_len: int = 512
    max_new_tokens: int = 53
    temperature: float = 0.7
    lr: float = 3e-6
    kl_coef: float = 0.05
    baseline_decay: float = 0.9
    warmup: int = 50
    total_updates: int = 2000
    eval_every: int = 200
    eval_batches: int = 20
    seed: int = 66
    extra: dict = field(default_factory=dict)


def load_config():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=None)
    ns, overrides = ap.parse_known_args()
    cfg = Config()
    if ns.config:
        with open(ns.config) as f:
            for k, v in (yaml.safe_load(f) or {}).items():
                setattr(cfg, k, v)
    for ov in overrides:
        k, v = ov.lstrip("-").split("=", 1)
        setattr(cfg, k, type(getattr(cfg, k))(v))
    return cfg


def seq_logprob(model, ids, attn, n_prompt):
    logits = model(input_ids=ids, attention_mask=attn).logits[:, n_prompt - 1:-1].float()
    lp = torch.log_softmax(logits, -1).gather(-1, ids[:, n_prompt:].unsqueeze(-1)).squeeze(-1)
    return lp


def response_mask(resp, eos_id):
    eos = (resp == eos_id).int()
    # keep tokens up to and including the first eos
    after = torch.cumsum(eos, dim=1) - eos
    return (after == 0).long()


@torch.no_grad()
def score(rm, rm_tok, prompts, summaries, device):
    enc = rm_tok(prompts, summaries, return_tensors="pt", padding=True, truncation="only_first",
                 max_length=768).to(device)
    return rm(**enc).logits.squeeze(-1).float()


def main():
    cfg = load_config()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format=f"[%(asctime)s r{rank}] %(message)s")
    torch.manual_seed(cfg.seed + rank)

    tok = AutoTokenizer.from_pretrained(cfg.sft_model, padding_side="left")
    if tok.pad_token is None:
        tok.add_special_tokens({"pad_token": "[PAD]"})

    policy = AutoModelForCausalLM.from_pretrained(cfg.sft_model, torch_dtype=torch.bfloat16)
    policy.resize_token_embeddings(len(tok))
    policy.to(device)
    ref = AutoModelForCausalLM.from_pretrained(cfg.sft_model, torch_dtype=torch.bfloat16)
    ref.resize_token_embeddings(len(tok))
    ref.to(device).eval().requires_grad_(False)

    rm_tok = AutoTokenizer.from_pretrained(cfg.reward_model)
    rm = AutoModelForSequenceClassification.from_pretrained(cfg.reward_model, torch_dtype=torch.bfloat16)
    rm.to(device).eval().requires_grad_(False)

    policy = DDP(policy, device_ids=[local_rank], output_device=local_rank)

    train = load_dataset(cfg.dataset, split="train")
    val = load_dataset(cfg.dataset, split="validation")
    tr_sampler = DistributedSampler(train, shuffle=True, seed=cfg.seed)
    va_sampler = DistributedSampler(val, shuffle=False)
    collate = lambda rows: [r["prompt"] for r in rows]  # noqa: E731
    train_dl = DataLoader(train, batch_size=cfg.batch_size, sampler=tr_sampler, collate_fn=collate,
                          drop_last=True, num_workers=2)
    val_dl = DataLoader(val, batch_size=cfg.batch_size, sampler=va_sampler, collate_fn=collate)

    opt = torch.optim.AdamW(policy.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=0.0)
    sched = get_linear_schedule_with_warmup(opt, cfg.warmup, cfg.total_updates)

    def generate(prompts, sample=True):
        enc = tok(prompts, return_tensors="pt", padding=True, truncation=True,
                  max_length=cfg.max_prompt_len).to(device)
        out = policy.module.generate(**enc, do_sample=sample, temperature=cfg.temperature, top_k=0,
                                     max_new_tokens=cfg.max_new_tokens, pad_token_id=tok.pad_token_id)
        resp = out[:, enc.input_ids.size(1):]
        mask = response_mask(resp, tok.eos_token_id)
        return out, torch.cat([enc.attention_mask, mask], 1), mask, enc.input_ids.size(1)

    baseline = 0.0
    update, epoch = 0, 0
    while update < cfg.total_updates:
        tr_sampler.set_epoch(epoch)
        for prompts in train_dl:
            policy.eval()
            with torch.no_grad():
                ids, attn, mask, P = generate(prompts)
                summaries = tok.batch_decode(ids[:, P:], skip_special_tokens=True)
                rewards = score(rm, rm_tok, prompts, summaries, device)
                ref_lp = seq_logprob(ref, ids, attn, P)
            policy.train()

            lp = seq_logprob(policy, ids, attn, P)
            kl = ((lp.detach() - ref_lp) * mask).sum(1)
            shaped = rewards - cfg.kl_coef * kl

            # global reward statistics for the baseline
            stats = torch.tensor([shaped.sum().item(), float(shaped.numel())], dtype=torch.float64)
            dist.all_reduce(stats, op=dist.ReduceOp.SUM)
            global_mean = (stats[0] / stats[1]).item()
            baseline = global_mean if update == 0 else cfg.baseline_decay * baseline + (1 - cfg.baseline_decay) * global_mean

            adv = (shaped - baseline).detach()
            loss = -(adv * (lp * mask).sum(1)).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            opt.step()
            sched.step()
            update += 1

            if update % 10 == 0:
                logger.info("upd %d  reward %.3f  kl %.3f  baseline %.3f  gnorm %.2f  len %.1f",
                            update, rewards.mean().item(), kl.mean().item(), baseline, gn.item(),
                            mask.sum(1).float().mean().item())

            if update % cfg.eval_every == 0:
                policy.eval()
                tot = torch.zeros(2, device=device)
                with torch.no_grad():
                    for i, vp in enumerate(val_dl):
                        if i >= cfg.eval_batches:
                            break
                        v_ids, _, _, vP = generate(vp, sample=False)
                        v_sum = tok.batch_decode(v_ids[:, vP:], skip_special_tokens=True)
                        r = score(rm, rm_tok, vp, v_sum, device)
                        tot += torch.stack([r.sum(), torch.tensor(float(r.numel()), device=device)])
                dist.all_reduce(tot)
                policy.train()
                if rank == 0:
                    logger.info("eval @%d: mean RM score (greedy) = %.4f", update, (tot[0] / tot[1]).item())
                    save_dir = os.path.join(cfg.out_dir, f"update_{update}")
                    policy.module.save_pretrained(save_dir)
                    tok.save_pretrained(save_dir)
                dist.barrier()

            if update >= cfg.total_updates:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()

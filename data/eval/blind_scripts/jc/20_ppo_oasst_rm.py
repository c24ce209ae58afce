"""PPO against an off-the-shelf reward model (OpenAssistant deberta RM) with its own tokenizer.

The reward model and the policy use different tokenizers, so responses are
decoded to text and re-tokenised for scoring (RewardScorer).

    torchrun --nproc_per_node=8 20_ppo_oasst_rm.py --policy ckpt/sft-opt-1.3b
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer


class RewardScorer:
    """Wraps a sequence-classification RM that scores (question, answer) text pairs."""

    def __init__(self, name, device="cuda:0", max_length=512, batch_size=32):
        self.tok = AutoTokenizer.from_pretrained(name)
        self.model = AutoModelForSequenceClassification.from_pretrained(name, torch_dtype=torch.float16)
        self.model.to(device).eval().requires_grad_(False)
        self.device = device
        self.max_length = max_length
        self.batch_size = batch_size

    @torch.no_grad()
    def __call__(self, questions, answers):
        out = []
        for i in range(0, len(questions), self.batch_size):
            enc = self.tok(questions[i:i + self.batch_size], answers[i:i + self.batch_size], padding=True,
                           truncation=True, max_length=self.max_length, return_tensors="pt").to(self.device)
            out.append(self.model(**enc).logits[:, 0].float())
        return torch.cat(out)


class ActorCritic(nn.Module):
    def __init__(self, path):
        super().__init__()
        self.lm = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16)
        self.critic = nn.Linear(self.lm.config.hidden_size, 1)
        nn.init.zeros_(self.critic.weight)
        nn.init.zeros_(self.critic.bias)

    def forward(self, ids, attn):
        o = self.lm(input_ids=ids, attention_mask=attn, output_hidden_states=True)
        return o.logits, self.critic(o.hidden_states[-1].float()).squeeze(-1)


def gather_lp(logits, ids):
    return torch.log_softmax(logits.float(), -1).gather(-1, ids[..., None]).squeeze(-1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", required=True)
    ap.add_argument("--reward_model", default="OpenAssistant/reward-model-deberta-v3-large-v2")
    ap.add_argument("--prompts", default="data/oasst_prompts.jsonl")
    ap.add_argument("--out", default="ckpt/ppo-opt-1.3b")
    ap.add_argument("--bs", type=int, default=32)
    ap.add_argument("--mbs", type=int, default=8)
    ap.add_argument("--epochs_per_batch", type=int, default=4)
    ap.add_argument("--iterations", type=int, default=600)
    ap.add_argument("--max_new_tokens", type=int, default=160)
    ap.add_argument("--lr", type=float, default=2e-6)
    ap.add_argument("--kl_coef", type=float, default=0.05)
    ap.add_argument("--clip", type=float, default=0.2)
    ap.add_argument("--seed", type=int, default=3)
    args = ap.parse_args()

    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.policy, padding_side="left")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token

    ac = ActorCritic(args.policy).to(device)
    ref = AutoModelForCausalLM.from_pretrained(args.policy, torch_dtype=torch.bfloat16).to(device)
    ref.eval().requires_grad_(False)
    scorer = RewardScorer(args.reward_model)
    model = DDP(ac, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, eps=1e-6)

    with open(args.prompts) as f:
        prompts = [json.loads(l)["prompt"] for l in f]
    sampler = DistributedSampler(prompts, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(prompts, batch_size=args.bs, sampler=sampler, drop_last=True)
    template = "<|prompter|>{}<|endoftext|><|assistant|>"
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(prompts)} prompts, {world} ranks, {len(loader)} iterations/epoch", flush=True)

    it, ep, t0 = 0, 0, time.time()
    while it < args.iterations:
        sampler.set_epoch(ep)
        ep += 1
        for qs in loader:
            qs = list(qs)
            enc = tok([template.format(q) for q in qs], return_tensors="pt", padding=True, truncation=True,
                      max_length=384).to(device)
            P = enc.input_ids.size(1)
            with torch.no_grad():
                ac.eval()
                seq = ac.lm.generate(**enc, do_sample=True, top_p=0.95, temperature=1.0,
                                     max_new_tokens=args.max_new_tokens, pad_token_id=tok.pad_token_id)
                resp = seq[:, P:]
                hit = resp == tok.eos_token_id
                end = torch.where(hit.any(1), hit.int().argmax(1), torch.full_like(resp[:, 0], resp.size(1) - 1))
                rmask = (torch.arange(resp.size(1), device=device)[None] <= end[:, None]).float()
                attn = torch.cat([enc.attention_mask, rmask.long()], 1)

                logits, values = ac(seq, attn)
                old_lp = gather_lp(logits[:, P - 1:-1], resp)
                values = values[:, P - 1:-1] * rmask
                ref_lp = gather_lp(ref(input_ids=seq, attention_mask=attn).logits[:, P - 1:-1], resp)
                answers = tok.batch_decode(resp * rmask.long() + tok.pad_token_id * (1 - rmask.long()),
                                           skip_special_tokens=True)
                score = scorer(qs, answers).to(device)

                kl = (old_lp - ref_lp) * rmask
                r = -args.kl_coef * kl
                r[torch.arange(len(qs), device=device), end] += score
                adv = torch.zeros_like(r)
                gl = torch.zeros_like(score)
                for t in reversed(range(resp.size(1))):
                    nv = values[:, t + 1] if t + 1 < resp.size(1) else torch.zeros_like(gl)
                    gl = r[:, t] + nv - values[:, t] + 0.95 * gl
                    adv[:, t] = gl
                ret = adv + values
                mu = (adv * rmask).sum() / rmask.sum()
                sd = ((((adv - mu) ** 2) * rmask).sum() / rmask.sum()).sqrt()
                adv = (adv - mu) / (sd + 1e-8) * rmask
                ac.train()

            for _ in range(args.epochs_per_batch):
                for idx in torch.randperm(len(qs), device=device).split(args.mbs):
                    lg, v = model(seq[idx], attn[idx])
                    lp = gather_lp(lg[:, P - 1:-1], resp[idx])
                    m = rmask[idx]
                    ratio = (lp - old_lp[idx]).exp()
                    pg = torch.max(-adv[idx] * ratio, -adv[idx] * ratio.clamp(1 - args.clip, 1 + args.clip))
                    pg_loss = (pg * m).sum() / m.sum()
                    vf_loss = 0.5 * (((v[:, P - 1:-1] - ret[idx]) ** 2) * m).sum() / m.sum()
                    opt.zero_grad(set_to_none=True)
                    (pg_loss + 0.1 * vf_loss).backward()
                    nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                    opt.step()

            it += 1
            st = torch.stack([score.mean(), kl.sum(1).mean(), rmask.sum(1).mean()])
            dist.all_reduce(st, op=dist.ReduceOp.AVG)
            if rank == 0 and it % 10 == 0:
                print(f"it {it} rm_score {st[0]:.3f} kl {st[1]:.3f} len {st[2]:.0f} {time.time() - t0:.0f}s",
                      flush=True)
            if rank == 0 and it % 100 == 0:
                ac.lm.save_pretrained(os.path.join(args.out, f"it{it}"))
                tok.save_pretrained(os.path.join(args.out, f"it{it}"))
            if it >= args.iterations:
                break

    if rank == 0:
        ac.lm.save_pretrained(os.path.join(args.out, "final"))
        tok.save_pretrained(os.path.join(args.out, "final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

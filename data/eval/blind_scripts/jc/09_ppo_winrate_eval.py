"""PPO trainer with periodic win-rate evaluation against the SFT (reference) policy.

Win rate = fraction of held-out prompts where the reward model prefers the PPO
policy's greedy response over the SFT policy's greedy response.

    torchrun --nproc_per_node=8 09_ppo_winrate_eval.py --config configs/ppo_hh.yaml
"""
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer


def masked_mean(x, m):
    return (x * m).sum() / m.sum().clamp_min(1.0)


def logp_of(logits, tokens):
    return torch.log_softmax(logits.float(), -1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


class PolicyValue(nn.Module):
    def __init__(self, path):
        super().__init__()
        self.lm = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16)
        self.vhead = nn.Linear(self.lm.config.hidden_size, 1)
        nn.init.zeros_(self.vhead.weight)
        nn.init.zeros_(self.vhead.bias)

    def forward(self, ids, attn):
        o = self.lm(input_ids=ids, attention_mask=attn, output_hidden_states=True)
        return o.logits, self.vhead(o.hidden_states[-1].float()).squeeze(-1)


class PPOTrainer:
    def __init__(self, cfg):
        self.cfg = cfg
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.device = torch.device("cuda", self.local_rank)

        self.tok = AutoTokenizer.from_pretrained(cfg["sft"], padding_side="left")
        self.tok.pad_token = self.tok.eos_token
        self.policy = PolicyValue(cfg["sft"]).to(self.device)
        self.ddp = DDP(self.policy, device_ids=[self.local_rank])
        self.ref = AutoModelForCausalLM.from_pretrained(cfg["sft"], torch_dtype=torch.bfloat16).to(self.device)
        self.rm = AutoModelForSequenceClassification.from_pretrained(
            cfg["rm"], num_labels=1, torch_dtype=torch.bfloat16).to(self.device)
        self.ref.eval().requires_grad_(False)
        self.rm.eval().requires_grad_(False)
        self.opt = torch.optim.AdamW(self.ddp.parameters(), lr=cfg["lr"], eps=1e-6)

        with open(cfg["train_prompts"]) as f:
            self.train_prompts = [json.loads(l)["prompt"] for l in f]
        with open(cfg["eval_prompts"]) as f:
            self.eval_prompts = [json.loads(l)["prompt"] for l in f]
        self.sampler = DistributedSampler(self.train_prompts, shuffle=True, seed=cfg["seed"], drop_last=True)
        self.loader = DataLoader(self.train_prompts, batch_size=cfg["rollout_bsz"], sampler=self.sampler,
                                 drop_last=True)

    def encode(self, prompts):
        return self.tok(prompts, return_tensors="pt", padding=True, truncation=True,
                        max_length=self.cfg["max_prompt_len"]).to(self.device)

    @torch.no_grad()
    def generate(self, model, enc, greedy=False):
        out = model.generate(**enc, max_new_tokens=self.cfg["max_new_tokens"], do_sample=not greedy,
                             top_p=1.0, top_k=0, pad_token_id=self.tok.eos_token_id)
        resp = out[:, enc.input_ids.size(1):]
        eos = resp == self.tok.eos_token_id
        end = torch.where(eos.any(1), eos.int().argmax(1), torch.full_like(eos[:, 0], resp.size(1) - 1, dtype=torch.long))
        rmask = (torch.arange(resp.size(1), device=self.device)[None] <= end[:, None]).long()
        attn = torch.cat([enc.attention_mask, rmask], 1)
        return out, resp, rmask, attn, end

    @torch.no_grad()
    def score(self, seq, attn):
        return self.rm(input_ids=seq, attention_mask=attn).logits.squeeze(-1).float()

    @torch.no_grad()
    def rollout(self, prompts):
        enc = self.encode(prompts)
        P = enc.input_ids.size(1)
        seq, resp, rmask, attn, end = self.generate(self.policy.lm, enc)
        logits, values = self.policy(seq, attn)
        old_lp = logp_of(logits[:, P - 1:-1], resp)
        ref_lp = logp_of(self.ref(input_ids=seq, attention_mask=attn).logits[:, P - 1:-1], resp)
        m = rmask.float()
        values = values[:, P - 1:-1] * m
        kl = (old_lp - ref_lp) * m
        rewards = -self.cfg["kl_coef"] * kl
        scores = self.score(seq, attn)
        rewards[torch.arange(seq.size(0), device=self.device), end] += scores
        adv = torch.zeros_like(rewards)
        g = torch.zeros(seq.size(0), device=self.device)
        for t in reversed(range(resp.size(1))):
            nv = values[:, t + 1] if t + 1 < resp.size(1) else torch.zeros_like(g)
            g = rewards[:, t] + nv - values[:, t] + self.cfg["lam"] * g
            adv[:, t] = g
        ret = adv + values
        mu = masked_mean(adv, m)
        sd = masked_mean((adv - mu) ** 2, m).sqrt()
        adv = (adv - mu) / (sd + 1e-8) * m
        return dict(seq=seq, attn=attn, resp=resp, m=m, P=P, old_lp=old_lp, values=values, adv=adv,
                    ret=ret, kl=kl.sum(1), scores=scores)

    def update(self, b):
        c = self.cfg
        P, n = b["P"], b["seq"].size(0)
        losses = []
        for _ in range(c["ppo_epochs"]):
            for idx in torch.randperm(n, device=self.device).split(c["minibatch"]):
                logits, v = self.ddp(b["seq"][idx], b["attn"][idx])
                lp = logp_of(logits[:, P - 1:-1], b["resp"][idx])
                v = v[:, P - 1:-1]
                m = b["m"][idx]
                ratio = (lp - b["old_lp"][idx]).exp()
                a = b["adv"][idx]
                pg = masked_mean(torch.max(-a * ratio, -a * ratio.clamp(1 - c["clip"], 1 + c["clip"])), m)
                vf = 0.5 * masked_mean((v - b["ret"][idx]) ** 2, m)
                loss = pg + c["vf_coef"] * vf
                self.opt.zero_grad(set_to_none=True)
                loss.backward()
                nn.utils.clip_grad_norm_(self.ddp.parameters(), c["max_grad_norm"])
                self.opt.step()
                losses.append(loss.detach())
        return torch.stack(losses).mean()

    @torch.no_grad()
    def evaluate_winrate(self, it):
        self.policy.eval()
        mine = self.eval_prompts[self.rank::self.world]
        wins = torch.zeros(2, device=self.device)
        for i in range(0, len(mine), self.cfg["eval_bsz"]):
            enc = self.encode(mine[i:i + self.cfg["eval_bsz"]])
            seq_pi, resp_pi, _, attn_pi, _ = self.generate(self.policy.lm, enc, greedy=True)
            seq_ref, _, _, attn_ref, _ = self.generate(self.ref, enc, greedy=True)
            r_pi, r_ref = self.score(seq_pi, attn_pi), self.score(seq_ref, attn_ref)
            wins[0] += (r_pi > r_ref).float().sum() + 0.5 * (r_pi == r_ref).float().sum()
            wins[1] += r_pi.numel()
        dist.all_reduce(wins)
        winrate = (wins[0] / wins[1]).item()

        # a few samples from every rank for the eval table
        first = self.encode(mine[: self.cfg["eval_bsz"]])
        _, resp, _, _, _ = self.generate(self.policy.lm, first, greedy=True)
        gathered = [torch.empty_like(resp) for _ in range(self.world)]
        dist.all_gather(gathered, resp)
        if self.rank == 0:
            path = os.path.join(self.cfg["out"], f"samples_{it:05d}.jsonl")
            with open(path, "w") as f:
                for r in torch.cat(gathered):
                    f.write(json.dumps({"response": self.tok.decode(r, skip_special_tokens=True)}) + "\n")
        self.policy.train()
        return winrate

    def train(self):
        c = self.cfg
        if self.rank == 0:
            os.makedirs(c["out"], exist_ok=True)
        it, ep, t0 = 0, 0, time.time()
        while it < c["iterations"]:
            self.sampler.set_epoch(ep)
            ep += 1
            for prompts in self.loader:
                self.policy.eval()
                b = self.rollout(list(prompts))
                self.policy.train()
                loss = self.update(b)
                it += 1
                st = torch.stack([loss, b["scores"].mean(), b["kl"].mean()])
                dist.all_reduce(st, op=dist.ReduceOp.AVG)
                if self.rank == 0 and it % c["log_every"] == 0:
                    print(f"it {it} loss {st[0]:.4f} score {st[1]:.3f} kl {st[2]:.3f} "
                          f"{time.time() - t0:.0f}s", flush=True)
                if it % c["eval_every"] == 0:
                    wr = self.evaluate_winrate(it)
                    if self.rank == 0:
                        print(f"it {it} win rate vs SFT {wr:.3f}", flush=True)
                        self.policy.lm.save_pretrained(os.path.join(c["out"], f"it{it}"))
                        torch.save(self.policy.vhead.state_dict(), os.path.join(c["out"], f"it{it}", "vhead.pt"))
                    dist.barrier()
                if it >= c["iterations"]:
                    break


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    with open(ap.parse_args().config) as f:
        cfg = yaml.safe_load(f)
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.manual_seed(cfg.get("seed", 0))
    PPOTrainer(cfg).train()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

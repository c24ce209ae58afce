"""Online GRPO against a sequence-classification reward model (UltraFeedback prompts).

    torchrun --nproc_per_node=8 05_grpo_ultrafeedback_rm.py \
        --policy Qwen/Qwen2.5-0.5B-Instruct --rm Skywork/Skywork-Reward-Llama-3.1-8B-v0.2
"""
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer


def is_main():
    return dist.get_rank() == 0


def log(*a):
    if is_main():
        print(time.strftime("%H:%M:%S"), *a, flush=True)


class RewardScorer:
    """Wraps the RM; it has its own tokenizer and chat template."""

    def __init__(self, name, max_len=2048):
        self.tok = AutoTokenizer.from_pretrained(name)
        self.model = AutoModelForSequenceClassification.from_pretrained(
            name, torch_dtype=torch.bfloat16, attn_implementation="flash_attention_2", num_labels=1)
        self.model.to("cuda:0").eval().requires_grad_(False)
        self.max_len = max_len

    @torch.no_grad()
    def __call__(self, questions, answers, bs=8):
        convs = [self.tok.apply_chat_template([{"role": "user", "content": q},
                                               {"role": "assistant", "content": a}], tokenize=False)
                 for q, a in zip(questions, answers)]
        scores = []
        for i in range(0, len(convs), bs):
            enc = self.tok(convs[i:i + bs], return_tensors="pt", padding=True, truncation=True,
                           max_length=self.max_len, add_special_tokens=False).to(self.model.device)
            scores.append(self.model(**enc).logits[:, 0].float())
        return torch.cat(scores)


class GRPOTrainer:
    def __init__(self, args):
        self.args = args
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.device = torch.device("cuda", self.local_rank)
        self.tok = AutoTokenizer.from_pretrained(args.policy, padding_side="left")
        pol = AutoModelForCausalLM.from_pretrained(args.policy, torch_dtype=torch.bfloat16,
                                                   attn_implementation="flash_attention_2").to(self.device)
        pol.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.ref = AutoModelForCausalLM.from_pretrained(args.policy, torch_dtype=torch.bfloat16,
                                                        attn_implementation="flash_attention_2").to(self.device)
        self.ref.eval().requires_grad_(False)
        self.policy = DDP(pol, device_ids=[self.local_rank])
        self.rm = RewardScorer(args.rm)
        self.opt = torch.optim.AdamW(self.policy.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.99))
        self.step = 0

    def logps(self, model, ids, attn, P):
        logits = model(input_ids=ids, attention_mask=attn, use_cache=False).logits[:, P - 1:-1]
        return torch.log_softmax(logits.float(), -1).gather(-1, ids[:, P:, None]).squeeze(-1)

    @torch.no_grad()
    def rollout(self, questions):
        a = self.args
        chats = [self.tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                              add_generation_prompt=True) for q in questions]
        enc = self.tok(chats, return_tensors="pt", padding=True, truncation=True,
                       max_length=a.max_prompt_len).to(self.device)
        ids = enc.input_ids.repeat_interleave(a.G, 0)
        am = enc.attention_mask.repeat_interleave(a.G, 0)
        self.policy.eval()
        self.policy.module.gradient_checkpointing_disable()
        self.policy.module.config.use_cache = True
        seq = self.policy.module.generate(input_ids=ids, attention_mask=am, do_sample=True, temperature=a.temp,
                                          top_p=0.95, max_new_tokens=a.max_new, pad_token_id=self.tok.pad_token_id)
        self.policy.module.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.policy.train()
        P = ids.size(1)
        resp = seq[:, P:]
        done = (resp == self.tok.eos_token_id).int()
        cmask = ((done.cumsum(1) - done) == 0).long()
        attn = torch.cat([am, cmask], 1)
        old = torch.cat([self.logps(self.policy.module, seq[i:i + a.mb], attn[i:i + a.mb], P)
                         for i in range(0, seq.size(0), a.mb)])
        ref = torch.cat([self.logps(self.ref, seq[i:i + a.mb], attn[i:i + a.mb], P)
                         for i in range(0, seq.size(0), a.mb)])
        answers = self.tok.batch_decode(resp, skip_special_tokens=True)
        qs = [q for q in questions for _ in range(a.G)]
        rewards = self.rm(qs, answers).to(self.device)
        # truncated answers get the minimum score of the batch
        truncated = done.sum(1) == 0
        rewards = torch.where(truncated, rewards.min().expand_as(rewards), rewards)
        g = rewards.view(-1, a.G)
        adv = ((g - g.mean(1, keepdim=True)) / (g.std(1, keepdim=True) + 1e-6)).flatten()
        return dict(seq=seq, attn=attn, cmask=cmask, old=old, ref=ref, adv=adv, rewards=rewards, P=P)

    def train_step(self, batch):
        a = self.args
        r = self.rollout(batch)
        n = r["seq"].size(0)
        self.opt.zero_grad(set_to_none=True)
        n_mb = math.ceil(n / a.mb)
        for k, i in enumerate(range(0, n, a.mb)):
            sl = slice(i, i + a.mb)
            sync = k == n_mb - 1
            with (self.policy.no_sync() if not sync else torch.enable_grad()):
                lp = self.logps(self.policy, r["seq"][sl], r["attn"][sl], r["P"])
                m = r["cmask"][sl].float()
                ratio = torch.exp(lp - r["old"][sl])
                adv = r["adv"][sl, None]
                pg = -torch.min(ratio * adv, torch.clamp(ratio, 1 - a.eps, 1 + a.eps) * adv)
                d = r["ref"][sl] - lp
                kl = torch.exp(d) - d - 1
                loss = ((pg + a.beta * kl) * m).sum() / r["cmask"].sum()
                loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), a.max_grad_norm)
        self.opt.step()
        self.step += 1
        stats = torch.stack([r["rewards"].mean(), r["cmask"].sum(1).float().mean(), gn.float()])
        dist.all_reduce(stats)
        return (stats / dist.get_world_size()).tolist()

    def save(self, tag):
        if is_main():
            path = os.path.join(self.args.out, tag)
            self.policy.module.save_pretrained(path)
            self.tok.save_pretrained(path)
        dist.barrier()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--policy", default="Qwen/Qwen2.5-0.5B-Instruct")
    ap.add_argument("--rm", default="Skywork/Skywork-Reward-Llama-3.1-8B-v0.2")
    ap.add_argument("--out", default="out/grpo_uf")
    ap.add_argument("--prompts", type=int, default=4, help="prompts per rank per step")
    ap.add_argument("--G", type=int, default=8)
    ap.add_argument("--mb", type=int, default=8)
    ap.add_argument("--max_prompt_len", type=int, default=512)
    ap.add_argument("--max_new", type=int, default=512)
    ap.add_argument("--temp", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--beta", type=float, default=0.02)
    ap.add_argument("--eps", type=float, default=0.2)
    ap.add_argument("--max_grad_norm", type=float, default=1.0)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--save_every", type=int, default=200)
    args = ap.parse_args()

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    torch.manual_seed(dist.get_rank() + 7)

    trainer = GRPOTrainer(args)
    ds = load_dataset("openbmb/UltraFeedback", split="train").select_columns(["instruction"])
    sampler = DistributedSampler(ds, shuffle=True, seed=0)
    dl = DataLoader(ds, batch_size=args.prompts, sampler=sampler, drop_last=True,
                    collate_fn=lambda rows: [r["instruction"] for r in rows])
    for ep in range(args.epochs):
        sampler.set_epoch(ep)
        for batch in dl:
            reward, length, gn = trainer.train_step(batch)
            if trainer.step % 10 == 0:
                log(f"ep {ep} step {trainer.step} reward {reward:.3f} len {length:.0f} gnorm {gn:.2f}")
            if trainer.step % args.save_every == 0:
                trainer.save(f"step_{trainer.step}")
    trainer.save("final")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

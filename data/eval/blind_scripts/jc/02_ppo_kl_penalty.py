"""PPO fine-tuning of an SFT policy against a learned reward model.

Policy and value head share the transformer trunk. A frozen copy of the SFT
model is the reference for the per-token KL penalty; the reward model is a
frozen scalar-head model trained with train_rm.py.

    torchrun --nproc_per_node=8 02_ppo_kl_penalty.py --sft_path ckpt/sft --rm_path ckpt/rm
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
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModel, AutoModelForCausalLM, AutoTokenizer


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sft_path", required=True)
    ap.add_argument("--rm_path", required=True)
    ap.add_argument("--prompts", default="data/prompts_train.jsonl")
    ap.add_argument("--out", default="ckpt/ppo")
    ap.add_argument("--rollout_batch", type=int, default=32, help="prompts per GPU per iteration")
    ap.add_argument("--mini_batch", type=int, default=8)
    ap.add_argument("--ppo_epochs", type=int, default=4)
    ap.add_argument("--iterations", type=int, default=400)
    ap.add_argument("--max_prompt_len", type=int, default=256)
    ap.add_argument("--max_new_tokens", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1.4e-6)
    ap.add_argument("--kl_coef", type=float, default=0.05)
    ap.add_argument("--clip", type=float, default=0.2)
    ap.add_argument("--vf_clip", type=float, default=0.2)
    ap.add_argument("--vf_coef", type=float, default=0.1)
    ap.add_argument("--gamma", type=float, default=1.0)
    ap.add_argument("--lam", type=float, default=0.95)
    ap.add_argument("--save_every", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


class PromptDataset(Dataset):
    def __init__(self, path):
        with open(path) as f:
            self.prompts = [json.loads(l)["prompt"] for l in f if l.strip()]

    def __len__(self):
        return len(self.prompts)

    def __getitem__(self, i):
        return self.prompts[i]


class ActorCritic(nn.Module):
    def __init__(self, path):
        super().__init__()
        self.lm = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.bfloat16)
        h = self.lm.config.hidden_size
        self.v_head = nn.Linear(h, 1, dtype=torch.bfloat16)
        nn.init.normal_(self.v_head.weight, std=1.0 / (h + 1))
        nn.init.zeros_(self.v_head.bias)

    def forward(self, input_ids, attention_mask, position_ids):
        out = self.lm(input_ids=input_ids, attention_mask=attention_mask,
                      position_ids=position_ids, output_hidden_states=True)
        values = self.v_head(out.hidden_states[-1]).squeeze(-1)
        return out.logits, values


class RewardModel(nn.Module):
    def __init__(self, path):
        super().__init__()
        self.backbone = AutoModel.from_pretrained(path, torch_dtype=torch.bfloat16)
        self.head = nn.Linear(self.backbone.config.hidden_size, 1, dtype=torch.bfloat16)
        self.head.load_state_dict(torch.load(os.path.join(path, "head.pt"), map_location="cpu"))

    def forward(self, input_ids, attention_mask, position_ids):
        h = self.backbone(input_ids=input_ids, attention_mask=attention_mask,
                          position_ids=position_ids).last_hidden_state
        last = attention_mask.shape[1] - 1 - attention_mask.flip(1).argmax(1)
        return self.head(h[torch.arange(h.shape[0], device=h.device), last]).squeeze(-1).float()


def logprobs_of(logits, labels):
    return torch.gather(F.log_softmax(logits.float(), dim=-1), 2, labels.unsqueeze(-1)).squeeze(-1)


def masked_mean(x, mask):
    return (x * mask).sum() / mask.sum().clamp(min=1)


def masked_whiten(x, mask, eps=1e-8):
    mean = masked_mean(x, mask)
    var = masked_mean((x - mean) ** 2, mask)
    return (x - mean) * torch.rsqrt(var + eps)


@torch.no_grad()
def make_experience(actor, ref, rm, tok, prompts, args, device):
    enc = tok(prompts, return_tensors="pt", padding=True, truncation=True,
              max_length=args.max_prompt_len).to(device)
    seq = actor.lm.generate(**enc, do_sample=True, top_p=1.0, top_k=0, temperature=1.0,
                            max_new_tokens=args.max_new_tokens, pad_token_id=tok.pad_token_id)
    plen = enc["input_ids"].shape[1]
    resp = seq[:, plen:]
    is_eos = resp == tok.eos_token_id
    end = torch.where(is_eos.any(1), is_eos.int().argmax(1), torch.full_like(resp[:, 0], resp.shape[1] - 1))
    ar = torch.arange(resp.shape[1], device=device)
    resp_mask = (ar[None, :] <= end[:, None]).long()
    attn = torch.cat([enc["attention_mask"], resp_mask], dim=1)
    pos = (attn.cumsum(1) - 1).clamp(min=0)

    logits, values = actor(seq, attn, pos)
    old_logp = logprobs_of(logits[:, plen - 1:-1], resp)
    values = values[:, plen - 1:-1].float()
    ref_logits = ref(input_ids=seq, attention_mask=attn, position_ids=pos).logits
    ref_logp = logprobs_of(ref_logits[:, plen - 1:-1], resp)
    score = rm(seq, attn, pos)

    m = resp_mask.float()
    kl = (old_logp - ref_logp) * m
    rewards = -args.kl_coef * kl
    rewards[torch.arange(resp.shape[0], device=device), end] += score

    adv = torch.zeros_like(rewards)
    last = torch.zeros(resp.shape[0], device=device)
    vals = values * m
    for t in reversed(range(resp.shape[1])):
        nxt = vals[:, t + 1] if t + 1 < resp.shape[1] else torch.zeros_like(last)
        delta = rewards[:, t] + args.gamma * nxt - vals[:, t]
        last = delta + args.gamma * args.lam * last
        adv[:, t] = last
    returns = adv + vals
    adv = masked_whiten(adv, m)
    return dict(seq=seq, attn=attn, pos=pos, plen=plen, resp=resp, mask=m, old_logp=old_logp,
                values=vals, adv=adv, returns=returns, kl=kl, score=score)


def ppo_step(actor, opt, exp, idx, args):
    plen = exp["plen"]
    logits, vpred = actor(exp["seq"][idx], exp["attn"][idx], exp["pos"][idx])
    logp = logprobs_of(logits[:, plen - 1:-1], exp["resp"][idx])
    vpred = vpred[:, plen - 1:-1].float()
    m = exp["mask"][idx]
    adv, old_logp = exp["adv"][idx], exp["old_logp"][idx]

    ratio = torch.exp(logp - old_logp)
    pg = torch.max(-adv * ratio, -adv * ratio.clamp(1 - args.clip, 1 + args.clip))
    pg_loss = masked_mean(pg, m)
    old_v = exp["values"][idx]
    v_clipped = old_v + (vpred - old_v).clamp(-args.vf_clip, args.vf_clip)
    vf = torch.max((vpred - exp["returns"][idx]) ** 2, (v_clipped - exp["returns"][idx]) ** 2)
    vf_loss = 0.5 * masked_mean(vf, m)
    loss = pg_loss + args.vf_coef * vf_loss

    opt.zero_grad(set_to_none=True)
    loss.backward()
    nn.utils.clip_grad_norm_(actor.parameters(), 1.0)
    opt.step()
    return pg_loss.detach(), vf_loss.detach(), masked_mean((ratio - 1) - torch.log(ratio), m).detach()


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed + rank)  # different sampling per rank; DDP syncs the weights

    tok = AutoTokenizer.from_pretrained(args.sft_path, padding_side="left")
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token

    actor = ActorCritic(args.sft_path).to(device)
    ref = AutoModelForCausalLM.from_pretrained(args.sft_path, torch_dtype=torch.bfloat16).to(device).eval()
    rm = RewardModel(args.rm_path).to(device).eval()
    for p in list(ref.parameters()) + list(rm.parameters()):
        p.requires_grad_(False)
    actor_ddp = DDP(actor, device_ids=[local_rank])
    opt = torch.optim.AdamW(actor_ddp.parameters(), lr=args.lr, eps=1e-5)

    ds = PromptDataset(args.prompts)
    sampler = DistributedSampler(ds, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(ds, batch_size=args.rollout_batch, sampler=sampler, drop_last=True)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        log_f = open(os.path.join(args.out, "log.jsonl"), "a")

    it, epoch = 0, 0
    t0 = time.time()
    while it < args.iterations:
        sampler.set_epoch(epoch)
        for prompts in loader:
            actor.eval()
            exp = make_experience(actor, ref, rm, tok, list(prompts), args, device)
            actor.train()
            n = exp["seq"].shape[0]
            pg_sum = vf_sum = approx_kl = 0.0
            n_updates = 0
            for _ in range(args.ppo_epochs):
                perm = torch.randperm(n, device=device)
                for s in range(0, n, args.mini_batch):
                    pg, vf, akl = ppo_step(actor_ddp, opt, exp, perm[s:s + args.mini_batch], args)
                    pg_sum += pg.item()
                    vf_sum += vf.item()
                    approx_kl += akl.item()
                    n_updates += 1

            mean_kl = exp["kl"].sum(1).mean().item()
            mean_score = exp["score"].mean().item()
            mean_len = exp["mask"].sum(1).mean().item()
            stats = torch.tensor([mean_kl, mean_score, mean_len, pg_sum / n_updates,
                                  vf_sum / n_updates, approx_kl / n_updates], dtype=torch.float64)
            dist.all_reduce(stats)
            stats /= world
            it += 1
            if rank == 0:
                rec = dict(iter=it, kl=stats[0].item(), score=stats[1].item(), resp_len=stats[2].item(),
                           pg_loss=stats[3].item(), vf_loss=stats[4].item(), approx_kl=stats[5].item(),
                           elapsed=round(time.time() - t0, 1))
                print(json.dumps(rec), flush=True)
                log_f.write(json.dumps(rec) + "\n")
                log_f.flush()
                if it % args.save_every == 0 or it == args.iterations:
                    d = os.path.join(args.out, f"iter_{it}")
                    actor.lm.save_pretrained(d)
                    tok.save_pretrained(d)
                    torch.save(actor.v_head.state_dict(), os.path.join(d, "v_head.pt"))
            if it >= args.iterations:
                break
        epoch += 1

    dist.barrier()
    if rank == 0:
        log_f.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

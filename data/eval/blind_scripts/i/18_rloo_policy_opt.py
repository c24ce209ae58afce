# RLOO (REINFORCE leave-one-out) against a frozen reward model, KL to the SFT reference.
# torchrun --nproc_per_node=8 18_rloo_policy_opt.py --policy ckpt/sft_qwen0.5b --rm ckpt/rm_qwen0.5b \
#     --prompts data/rl_prompts.jsonl
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--policy", required=True)
    p.add_argument("--rm", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--k", type=int, default=4, help="samples per prompt")
    p.add_argument("--prompts_per_rank", type=int, default=8)
    p.add_argument("--max_new", type=int, default=256)
    p.add_argument("--kl_coef", type=float, default=0.05)
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--iters", type=int, default=1000)
    p.add_argument("--temperature", type=float, default=0.9)
    p.add_argument("--save_every", type=int, default=100)
    p.add_argument("--out", default="ckpt/rloo")
    return p.parse_args()


class Prompts(Dataset):
    def __init__(self, path):
        self.p = [json.loads(l)["prompt"] for l in open(path)]

    def __len__(self):
        return len(self.p)

    def __getitem__(self, i):
        return self.p[i]


def token_logps(model, ids, attn, n_prompt):
    logits = model(input_ids=ids, attention_mask=attn).logits[:, n_prompt - 1:-1].float()
    tgt = ids[:, n_prompt:]
    return torch.gather(logits.log_softmax(-1), 2, tgt.unsqueeze(-1)).squeeze(-1)


def reduce_stats(stats):
    keys = sorted(stats)
    t = torch.tensor([float(stats[k]) for k in keys], dtype=torch.float64)
    dist.all_reduce(t)
    t /= dist.get_world_size()
    return dict(zip(keys, t.tolist()))


@torch.no_grad()
def score(rm, rm_tok, texts, device):
    enc = rm_tok(texts, return_tensors="pt", padding=True, truncation=True, max_length=1024).to(device)
    return rm(**enc).logits.squeeze(-1).float()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(1000 + rank)  # different samples per rank; weights come from the checkpoint

    tok = AutoTokenizer.from_pretrained(args.policy, padding_side="left")
    tok.pad_token = tok.pad_token or tok.eos_token
    rm_tok = AutoTokenizer.from_pretrained(args.rm)
    rm_tok.pad_token = rm_tok.pad_token or rm_tok.eos_token

    policy = AutoModelForCausalLM.from_pretrained(args.policy, torch_dtype=torch.bfloat16).to(dev)
    ref = AutoModelForCausalLM.from_pretrained(args.policy, torch_dtype=torch.bfloat16).to(dev).eval()
    rm = AutoModelForSequenceClassification.from_pretrained(args.rm, torch_dtype=torch.bfloat16).to(dev).eval()
    ref.requires_grad_(False)
    rm.requires_grad_(False)
    rm.config.pad_token_id = rm_tok.pad_token_id
    policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy = DDP(policy, device_ids=[local_rank])
    opt = torch.optim.AdamW(policy.parameters(), lr=args.lr, weight_decay=0.0)

    ds = Prompts(args.prompts)
    sampler = DistributedSampler(ds, shuffle=True, seed=0, drop_last=True)
    dl = DataLoader(ds, batch_size=args.prompts_per_rank, sampler=sampler, drop_last=True)

    it, epoch = 0, 0
    while it < args.iters:
        sampler.set_epoch(epoch)
        for prompts in dl:
            t0 = time.time()
            chats = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                             add_generation_prompt=True) for p in prompts]
            enc = tok(chats, return_tensors="pt", padding=True).to(dev)
            n_prompt = enc.input_ids.size(1)

            policy.module.eval()
            policy.module.config.use_cache = True
            with torch.no_grad():
                seqs = policy.module.generate(**enc, do_sample=True, temperature=args.temperature, top_p=1.0,
                                              max_new_tokens=args.max_new, num_return_sequences=args.k,
                                              pad_token_id=tok.pad_token_id)
            policy.module.config.use_cache = False
            policy.module.train()

            attn = (seqs != tok.pad_token_id).long()
            attn[:, :n_prompt] = enc.attention_mask.repeat_interleave(args.k, 0)
            resp_mask = attn[:, n_prompt:].float()
            texts = tok.batch_decode(seqs[:, n_prompt:], skip_special_tokens=True)
            full = [p + r for p, r in zip([c for c in chats for _ in range(args.k)], texts)]
            rewards = score(rm, rm_tok, full, dev)

            with torch.no_grad():
                ref_lp = token_logps(ref, seqs, attn, n_prompt)
            lp = token_logps(policy, seqs, attn, n_prompt)
            kl = ((lp.detach() - ref_lp) * resp_mask).sum(-1)
            r_tot = (rewards - args.kl_coef * kl).view(-1, args.k)
            baseline = (r_tot.sum(1, keepdim=True) - r_tot) / (args.k - 1)
            adv = (r_tot - baseline).view(-1)
            seq_lp = (lp * resp_mask).sum(-1)
            loss = -(adv * seq_lp).mean()

            opt.zero_grad(set_to_none=True)
            loss.backward()
            gn = torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            opt.step()
            it += 1

            stats = reduce_stats({"loss": loss.item(), "reward": rewards.mean().item(), "kl": kl.mean().item(),
                                  "resp_len": resp_mask.sum(-1).mean().item(), "grad_norm": gn.item()})
            if rank == 0 and it % 5 == 0:
                print(f"it {it} " + " ".join(f"{k}={v:.4f}" for k, v in stats.items()) +
                      f" ({time.time() - t0:.1f}s)", flush=True)
            if it % args.save_every == 0:
                if rank == 0:
                    policy.module.save_pretrained(os.path.join(args.out, f"it{it}"))
                    tok.save_pretrained(os.path.join(args.out, f"it{it}"))
                dist.barrier()
            if it >= args.iters:
                break
        epoch += 1

    dist.destroy_process_group()


if __name__ == "__main__":
    main()

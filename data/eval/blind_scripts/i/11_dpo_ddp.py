# hand-rolled DPO (sigmoid loss) with a frozen reference model
# torchrun --nproc_per_node=8 11_dpo_ddp.py --policy ckpt/sft_qwen1.5b --data data/ultrafeedback_bin.jsonl
import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
import wandb
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--policy", required=True)
    p.add_argument("--ref", default=None, help="defaults to --policy")
    p.add_argument("--data", required=True)
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--label_smoothing", type=float, default=0.0)
    p.add_argument("--lr", type=float, default=5e-7)
    p.add_argument("--bsz", type=int, default=4)
    p.add_argument("--accum", type=int, default=4)
    p.add_argument("--max_len", type=int, default=1024)
    p.add_argument("--max_prompt_len", type=int, default=512)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--out", default="ckpt/dpo")
    p.add_argument("--run_name", default=None)
    return p.parse_args()


class PrefData(Dataset):
    def __init__(self, path, tok, max_len, max_prompt_len):
        self.rows = [json.loads(l) for l in open(path)]
        self.tok, self.max_len, self.max_prompt = tok, max_len, max_prompt_len

    def __len__(self):
        return len(self.rows)

    def _build(self, prompt_ids, resp):
        r = self.tok(resp + self.tok.eos_token, add_special_tokens=False)["input_ids"]
        ids = (prompt_ids + r)[: self.max_len]
        labels = ([-100] * len(prompt_ids) + r)[: self.max_len]
        return ids, labels

    def __getitem__(self, i):
        row = self.rows[i]
        prompt = self.tok.apply_chat_template([{"role": "user", "content": row["prompt"]}],
                                              tokenize=True, add_generation_prompt=True)
        prompt = prompt[-self.max_prompt:]
        return self._build(prompt, row["chosen"]), self._build(prompt, row["rejected"])


def collate(batch, pad_id):
    seqs = [b[0] for b in batch] + [b[1] for b in batch]  # chosen first, then rejected
    n = max(len(s[0]) for s in seqs)
    ids = torch.full((len(seqs), n), pad_id)
    labels = torch.full((len(seqs), n), -100)
    attn = torch.zeros((len(seqs), n), dtype=torch.long)
    for i, (x, y) in enumerate(seqs):
        ids[i, : len(x)] = torch.tensor(x)
        labels[i, : len(y)] = torch.tensor(y)
        attn[i, : len(x)] = 1
    return ids, labels, attn


class Collate:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, batch):
        return collate(batch, self.pad_id)


def seq_logps(model, ids, labels, attn):
    logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    tgt = labels[:, 1:]
    mask = tgt != -100
    lp = torch.gather(logits.log_softmax(-1), 2, tgt.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (lp * mask).sum(-1)


def dpo_loss(pol, ref, beta, ls):
    half = pol.size(0) // 2
    pi_logratio = pol[:half] - pol[half:]
    ref_logratio = ref[:half] - ref[half:]
    logits = beta * (pi_logratio - ref_logratio)
    loss = -F.logsigmoid(logits) * (1 - ls) - F.logsigmoid(-logits) * ls
    chosen_r = beta * (pol[:half] - ref[:half]).detach()
    rejected_r = beta * (pol[half:] - ref[half:]).detach()
    return loss.mean(), chosen_r, rejected_r


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    wandb.init(project="dpo", name=args.run_name, config={**vars(args), "world_size": world})

    tok = AutoTokenizer.from_pretrained(args.policy)
    tok.pad_token = tok.pad_token or tok.eos_token
    policy = AutoModelForCausalLM.from_pretrained(args.policy, torch_dtype=torch.bfloat16).to(device)
    policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy.config.use_cache = False
    ref = AutoModelForCausalLM.from_pretrained(args.ref or args.policy, torch_dtype=torch.bfloat16).to(device)
    ref.eval().requires_grad_(False)
    policy = DDP(policy, device_ids=[local_rank])

    ds = PrefData(args.data, tok, args.max_len, args.max_prompt_len)
    sampler = DistributedSampler(ds, shuffle=True, seed=42)
    dl = DataLoader(ds, batch_size=args.bsz, sampler=sampler, collate_fn=Collate(tok.pad_token_id),
                    num_workers=2, drop_last=True)
    opt = torch.optim.RMSprop(policy.parameters(), lr=args.lr)
    warmup = 150
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warmup))

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        policy.train()
        acc = torch.zeros(4, device=device)
        t0 = time.time()
        for i, (ids, labels, attn) in enumerate(dl):
            ids, labels, attn = ids.to(device), labels.to(device), attn.to(device)
            with torch.no_grad():
                ref_lp = seq_logps(ref, ids, labels, attn)
            sync = (i + 1) % args.accum == 0
            ctx = policy.no_sync() if not sync else torch.enable_grad()
            with ctx:
                pol_lp = seq_logps(policy, ids, labels, attn)
                loss, r_c, r_r = dpo_loss(pol_lp, ref_lp, args.beta, args.label_smoothing)
                (loss / args.accum).backward()
            acc += torch.stack([loss.detach(), (r_c > r_r).float().mean(), r_c.mean(), r_r.mean()])
            if not sync:
                continue
            torch.nn.utils.clip_grad_norm_(policy.parameters(), 10.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % 10 == 0:
                dist.all_reduce(acc, op=dist.ReduceOp.AVG)
                acc /= 10 * args.accum
                wandb.log({"loss": acc[0].item(), "rewards/accuracy": acc[1].item(),
                           "rewards/chosen": acc[2].item(), "rewards/rejected": acc[3].item(),
                           "rewards/margin": (acc[2] - acc[3]).item(), "lr": sched.get_last_lr()[0],
                           "sec_per_step": (time.time() - t0) / 10}, step=step)
                acc.zero_()
                t0 = time.time()

        if rank == 0:
            out = os.path.join(args.out, f"epoch{epoch}")
            policy.module.save_pretrained(out, safe_serialization=True)
            tok.save_pretrained(out)
        dist.barrier()

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

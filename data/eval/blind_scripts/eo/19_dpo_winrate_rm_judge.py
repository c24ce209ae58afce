"""DPO with an online win-rate probe.

Every --probe_every updates we sample greedy completions from the policy and from the
frozen SFT reference on a fixed set of held-out prompts, score both with our reward
model, and report how often the policy's completion scores higher.

    torchrun --nproc_per_node=8 19_dpo_winrate_rm_judge.py --sft ckpts/sft-qwen2.5-1.5b \
        --rm ckpts/rm-qwen2.5-1.5b --pairs data/pairs.jsonl --probe_prompts data/probe_prompts.jsonl
"""
import argparse
import contextlib
import json
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import (AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer,
                          get_linear_schedule_with_warmup)

IGNORE = -100


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--sft", required=True)
    p.add_argument("--rm", required=True)
    p.add_argument("--pairs", required=True)
    p.add_argument("--probe_prompts", required=True)
    p.add_argument("--out", default="runs/dpo-probe")
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=5e-7)
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--bs", type=int, default=4)
    p.add_argument("--accum", type=int, default=2)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--max_len", type=int, default=768)
    p.add_argument("--max_prompt_len", type=int, default=384)
    p.add_argument("--gen_len", type=int, default=256)
    p.add_argument("--probe_every", type=int, default=250)
    p.add_argument("--n_probe", type=int, default=256)
    return p.parse_args()


class PairData(Dataset):
    def __init__(self, path, tok, max_len, max_prompt_len):
        self.items = []
        for line in open(path):
            r = json.loads(line)
            prompt = tok.apply_chat_template([{"role": "user", "content": r["prompt"]}],
                                             tokenize=False, add_generation_prompt=True)
            p = tok(prompt, add_special_tokens=False)["input_ids"][-max_prompt_len:]
            c = tok(r["chosen"] + tok.eos_token, add_special_tokens=False)["input_ids"][: max_len - len(p)]
            j = tok(r["rejected"] + tok.eos_token, add_special_tokens=False)["input_ids"][: max_len - len(p)]
            self.items.append((p, c, j))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class PadPairs:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, batch):
        seqs = [(p, c) for p, c, _ in batch] + [(p, j) for p, _, j in batch]
        T = max(len(p) + len(r) for p, r in seqs)
        ids = torch.full((len(seqs), T), self.pad_id, dtype=torch.long)
        labels = torch.full_like(ids, IGNORE)
        mask = torch.zeros_like(ids)
        for i, (p, r) in enumerate(seqs):
            ids[i, : len(p) + len(r)] = torch.tensor(p + r)
            labels[i, len(p): len(p) + len(r)] = torch.tensor(r)
            mask[i, : len(p) + len(r)] = 1
        return ids, mask, labels


def pair_logps(model, ids, mask, labels):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(input_ids=ids, attention_mask=mask).logits
    logits = logits[:, :-1].float()
    tgt = labels[:, 1:]
    valid = tgt != IGNORE
    lp = torch.gather(logits.log_softmax(-1), 2, tgt.masked_fill(~valid, 0).unsqueeze(2)).squeeze(2)
    lp = (lp * valid).sum(-1)
    n = lp.size(0) // 2
    return lp[:n], lp[n:]


@torch.no_grad()
def rm_scores(rm, rm_tok, prompts, completions, device):
    texts = [rm_tok.apply_chat_template([{"role": "user", "content": p}, {"role": "assistant", "content": c}],
                                        tokenize=False) for p, c in zip(prompts, completions)]
    enc = rm_tok(texts, return_tensors="pt", padding=True, truncation=True, max_length=1024).to(device)
    return rm(**enc).logits.squeeze(-1).float()


@torch.no_grad()
def generate(lm, gen_tok, prompts, max_new_tokens, device):
    chat = [gen_tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
            for p in prompts]
    enc = gen_tok(chat, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
    out = lm.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False, use_cache=True,
                      pad_token_id=gen_tok.pad_token_id)
    return gen_tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)


def probe_winrate(policy, ref, rm, gen_tok, rm_tok, prompts, args, device):
    was_training = policy.training
    policy.eval()
    wins = torch.zeros(2, device=device)
    for i in range(0, len(prompts), 8):
        chunk = prompts[i: i + 8]
        pol_out = generate(policy, gen_tok, chunk, args.gen_len, device)
        ref_out = generate(ref, gen_tok, chunk, args.gen_len, device)
        s_pol = rm_scores(rm, rm_tok, chunk, pol_out, device)
        s_ref = rm_scores(rm, rm_tok, chunk, ref_out, device)
        wins[0] += (s_pol > s_ref).float().sum() + 0.5 * (s_pol == s_ref).float().sum()
        wins[1] += len(chunk)
    dist.all_reduce(wins)
    policy.train(was_training)
    return (wins[0] / wins[1]).item()


def main():
    args = get_args()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    tok = AutoTokenizer.from_pretrained(args.sft)
    gen_tok = AutoTokenizer.from_pretrained(args.sft, padding_side="left")
    rm_tok = AutoTokenizer.from_pretrained(args.rm)
    for t in (tok, gen_tok, rm_tok):
        if t.pad_token is None:
            t.pad_token = t.eos_token

    data = PairData(args.pairs, tok, args.max_len, args.max_prompt_len)
    sampler = DistributedSampler(data, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(data, batch_size=args.bs, sampler=sampler, collate_fn=PadPairs(tok.pad_token_id),
                        num_workers=2, pin_memory=True)
    probe = [json.loads(l)["prompt"] for l in open(args.probe_prompts)]
    random.Random(1234).shuffle(probe)
    probe = probe[: args.n_probe][rank::world]

    policy = AutoModelForCausalLM.from_pretrained(args.sft, torch_dtype=torch.float32).to(device)
    ref = AutoModelForCausalLM.from_pretrained(args.sft, torch_dtype=torch.bfloat16).to(device).eval()
    rm = AutoModelForSequenceClassification.from_pretrained(args.rm, num_labels=1, torch_dtype=torch.bfloat16)
    rm.config.pad_token_id = rm_tok.pad_token_id
    rm.to(device).eval()
    ref.requires_grad_(False)
    rm.requires_grad_(False)
    model = DDP(policy, device_ids=[local_rank])

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    n_updates = (len(loader) // args.accum) * args.epochs
    sched = get_linear_schedule_with_warmup(opt, args.warmup, n_updates)
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        log_f = open(os.path.join(args.out, "log.jsonl"), "a")

    upd = 0
    t0 = time.time()
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for it, (ids, mask, labels) in enumerate(loader):
            ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
            step_now = (it + 1) % args.accum == 0
            with contextlib.nullcontext() if step_now else model.no_sync():
                pc, pr = pair_logps(model, ids, mask, labels)
                with torch.no_grad():
                    rc, rr = pair_logps(ref, ids, mask, labels)
                logits = (pc - pr) - (rc - rr)
                loss = -F.logsigmoid(args.beta * logits).mean()
                (loss / args.accum).backward()
            if not step_now:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 10.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            upd += 1

            if upd % 10 == 0:
                acc = (logits > 0).float().mean()
                stats = torch.stack([loss.detach(), acc, args.beta * logits.detach().mean()])
                dist.all_reduce(stats, op=dist.ReduceOp.AVG)
                if rank == 0:
                    rec = {"upd": upd, "loss": stats[0].item(), "acc": stats[1].item(),
                           "margin": stats[2].item(), "lr": sched.get_last_lr()[0], "t": time.time() - t0}
                    log_f.write(json.dumps(rec) + "\n")
                    log_f.flush()

            if upd % args.probe_every == 0:
                wr = probe_winrate(model, ref, rm, gen_tok, rm_tok, probe, args, device)
                if rank == 0:
                    print(f"upd {upd}: win-rate vs SFT = {wr:.3f}", flush=True)
                    log_f.write(json.dumps({"upd": upd, "winrate_vs_sft": wr}) + "\n")
                    log_f.flush()

    if rank == 0:
        model.module.save_pretrained(os.path.join(args.out, "final"))
        tok.save_pretrained(os.path.join(args.out, "final"))
        log_f.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

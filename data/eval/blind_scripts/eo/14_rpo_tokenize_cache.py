"""DPO + NLL on the chosen response (RPO-style) for math preference pairs.

Tokenising ~500k pairs with the chat template takes ~15 min, so the tokenised pairs
are cached next to the data file and reused by later runs.

    torchrun --nproc_per_node=8 14_rpo_tokenize_cache.py --model ckpts/qwen2.5-math-1.5b-sft \
        --data /shared/data/math_pairs_v2.jsonl --out /shared/runs/rpo-math-1.5b
"""
import argparse
import hashlib
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

IGNORE = -100


def cli():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--beta", type=float, default=0.1)
    ap.add_argument("--alpha", type=float, default=1.0, help="weight of the chosen NLL term")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--max_len", type=int, default=1536)
    ap.add_argument("--max_prompt_len", type=int, default=512)
    ap.add_argument("--save_every", type=int, default=1000)
    return ap.parse_args()


def tokenize_file(path, tok, max_len, max_prompt_len, show_progress):
    out = []
    with open(path) as f:
        lines = f.readlines()
    for line in tqdm(lines, disable=not show_progress, desc="tokenize"):
        r = json.loads(line)
        p = tok.apply_chat_template([{"role": "user", "content": r["question"]}], tokenize=True,
                                    add_generation_prompt=True)[-max_prompt_len:]
        c = tok(r["chosen"], add_special_tokens=False).input_ids + [tok.eos_token_id]
        j = tok(r["rejected"], add_special_tokens=False).input_ids + [tok.eos_token_id]
        room = max_len - len(p)
        out.append({"p": p, "c": c[:room], "j": j[:room]})
    return out


def cached_pairs(path, tok, max_len, max_prompt_len, show_progress):
    key = hashlib.md5(f"{tok.name_or_path}|{max_len}|{max_prompt_len}".encode()).hexdigest()[:10]
    cache = f"{path}.tok-{key}.pt"
    if os.path.exists(cache):
        return torch.load(cache)
    pairs = tokenize_file(path, tok, max_len, max_prompt_len, show_progress)
    torch.save(pairs, cache)
    return pairs


class PairDS(Dataset):
    def __init__(self, pairs):
        self.pairs = pairs

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, i):
        return self.pairs[i]


class Collator:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, batch):
        seqs = [(b["p"], b["c"]) for b in batch] + [(b["p"], b["j"]) for b in batch]
        T = max(len(p) + len(r) for p, r in seqs)
        ids = torch.full((len(seqs), T), self.pad_id, dtype=torch.long)
        lab = torch.full((len(seqs), T), IGNORE, dtype=torch.long)
        att = torch.zeros((len(seqs), T), dtype=torch.long)
        for i, (p, r) in enumerate(seqs):
            ids[i, : len(p) + len(r)] = torch.tensor(p + r)
            lab[i, len(p): len(p) + len(r)] = torch.tensor(r)
            att[i, : len(p) + len(r)] = 1
        return ids, att, lab


def seq_stats(model, ids, att, lab):
    """Returns summed response log-probs and number of response tokens per row."""
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = model(input_ids=ids, attention_mask=att).logits
    logits = logits[:, :-1].float()
    tgt = lab[:, 1:]
    m = tgt != IGNORE
    lp = torch.gather(logits.log_softmax(-1), 2, tgt.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (lp * m).sum(-1), m.sum(-1)


def main():
    args = cli()
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dev = torch.device("cuda", local_rank)
    torch.manual_seed(0)

    tok = AutoTokenizer.from_pretrained(args.model)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token

    t_load = time.time()
    pairs = cached_pairs(args.data, tok, args.max_len, args.max_prompt_len, show_progress=(rank == 0))
    dataset = PairDS(pairs)
    if rank == 0:
        print(f"{len(dataset)} pairs ready in {time.time() - t_load:.0f}s", flush=True)

    sampler = DistributedSampler(dataset, shuffle=True, seed=0, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.bs, sampler=sampler, collate_fn=Collator(tok.pad_token_id),
                        num_workers=4, pin_memory=True)

    policy = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy.config.use_cache = False
    policy.to(dev)
    ref = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16).to(dev).eval()
    ref.requires_grad_(False)
    model = DDP(policy, device_ids=[local_rank])

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    total = len(loader) * args.epochs
    sched = get_cosine_schedule_with_warmup(opt, args.warmup, total)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for ids, att, lab in loader:
            ids, att, lab = ids.to(dev, non_blocking=True), att.to(dev, non_blocking=True), lab.to(dev, non_blocking=True)
            n = ids.size(0) // 2
            lp, ntok = seq_stats(model, ids, att, lab)
            with torch.no_grad():
                ref_lp, _ = seq_stats(ref, ids, att, lab)
            h = (lp[:n] - lp[n:]) - (ref_lp[:n] - ref_lp[n:])
            dpo = -F.logsigmoid(args.beta * h).mean()
            nll = -(lp[:n] / ntok[:n].clamp(min=1)).mean()
            loss = dpo + args.alpha * nll
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1

            if step % 20 == 0:
                s = torch.stack([dpo.detach(), nll.detach(), (h > 0).float().mean(), args.beta * h.mean()])
                dist.all_reduce(s, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"step {step}/{total} dpo {s[0]:.4f} nll {s[1]:.4f} acc {s[2]:.3f} margin {s[3]:.3f} "
                          f"lr {sched.get_last_lr()[0]:.2e}", flush=True)

            if step % args.save_every == 0:
                if rank == 0:
                    d = os.path.join(args.out, f"step{step}")
                    model.module.save_pretrained(d)
                    tok.save_pretrained(d)
                dist.barrier()

    if rank == 0:
        model.module.save_pretrained(os.path.join(args.out, "final"))
        tok.save_pretrained(os.path.join(args.out, "final"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

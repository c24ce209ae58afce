"""GRPO for closed-book short-answer QA (TriviaQA), reward = token F1 with the aliases.

    torchrun --nproc_per_node 8 13_grpo_triviaqa_f1.py --run_name tqa-grpo-llama1b
"""
import argparse
import collections
import contextlib
import os
import re
import string
import time

import torch
import torch.distributed as dist
import wandb
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_linear_schedule_with_warmup


def normalize(s):
    s = s.lower()
    s = "".join(ch for ch in s if ch not in set(string.punctuation))
    s = re.sub(r"\b(a|an|the)\b", " ", s)
    return " ".join(s.split())


def f1(pred, gold):
    p, g = normalize(pred).split(), normalize(gold).split()
    common = collections.Counter(p) & collections.Counter(g)
    same = sum(common.values())
    if same == 0:
        return 0.0
    prec, rec = same / len(p), same / len(g)
    return 2 * prec * rec / (prec + rec)


def qa_reward(completion, aliases):
    m = re.search(r"Answer:\s*(.+)", completion)
    if m is None:
        return -0.2
    pred = m.group(1).strip().split("\n")[0]
    return max(f1(pred, a) for a in aliases)


def seq_logps(model, ids, attn, P):
    logits = model(input_ids=ids, attention_mask=attn).logits[:, P - 1:-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[:, P:].unsqueeze(-1)).squeeze(-1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="meta-llama/Llama-3.2-1B-Instruct")
    ap.add_argument("--run_name", default="tqa-grpo")
    ap.add_argument("--out", default="/checkpoints/tqa")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--G", type=int, default=4)
    ap.add_argument("--micro", type=int, default=16)
    ap.add_argument("--max_new", type=int, default=64)
    ap.add_argument("--lr", type=float, default=2e-6)
    ap.add_argument("--beta", type=float, default=0.05)
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--save_every", type=int, default=250)
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(rank * 1000 + 1)

    wandb.init(project="rl-qa", name=args.run_name, config=vars(args))

    tok = AutoTokenizer.from_pretrained(args.model, padding_side="left")
    tok.pad_token = tok.pad_token or "<|finetune_right_pad_id|>"
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16).to(device)
    ref = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16).to(device).eval()
    ref.requires_grad_(False)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    sched = get_linear_schedule_with_warmup(opt, args.warmup, args.steps)

    ds = load_dataset("mandarjoshi/trivia_qa", "rc.nocontext", split="train")
    ds = ds.map(lambda ex: {"aliases": ex["answer"]["normalized_aliases"] + [ex["answer"]["value"]]},
                remove_columns=["answer", "search_results", "entity_pages"])
    sampler = DistributedSampler(ds, shuffle=True, seed=1)
    dl = DataLoader(ds, batch_size=args.batch, sampler=sampler, drop_last=True, collate_fn=lambda x: x,
                    num_workers=2, persistent_workers=True)

    def prompt(q):
        return tok.apply_chat_template(
            [{"role": "user", "content": f"{q}\nThink briefly, then reply on the last line as 'Answer: <answer>'."}],
            tokenize=False, add_generation_prompt=True)

    step, epoch = 0, 0
    it = iter(dl)
    while step < args.steps:
        try:
            rows = next(it)
        except StopIteration:
            epoch += 1
            sampler.set_epoch(epoch)
            it = iter(dl)
            rows = next(it)
        t0 = time.time()

        enc = tok([prompt(r["question"]) for r in rows], return_tensors="pt", padding=True,
                  add_special_tokens=False).to(device)
        ids = enc.input_ids.repeat_interleave(args.G, 0)
        am = enc.attention_mask.repeat_interleave(args.G, 0)
        P = ids.size(1)
        model.eval()
        with torch.no_grad():
            seq = model.module.generate(input_ids=ids, attention_mask=am, do_sample=True, temperature=1.0,
                                        max_new_tokens=args.max_new, pad_token_id=tok.pad_token_id,
                                        eos_token_id=[eot, tok.eos_token_id])
            resp = seq[:, P:]
            stop = ((resp == eot) | (resp == tok.eos_token_id)).int()
            mask = ((stop.cumsum(1) - stop) == 0).long()
            attn = torch.cat([am, mask], 1)
            old = torch.cat([seq_logps(model.module, seq[i:i + args.micro], attn[i:i + args.micro], P)
                             for i in range(0, seq.size(0), args.micro)])
            rlp = torch.cat([seq_logps(ref, seq[i:i + args.micro], attn[i:i + args.micro], P)
                             for i in range(0, seq.size(0), args.micro)])
        model.train()
        gen_time = time.time() - t0

        texts = tok.batch_decode(resp, skip_special_tokens=True)
        aliases = [r["aliases"] for r in rows for _ in range(args.G)]
        rew = torch.tensor([qa_reward(t, a) for t, a in zip(texts, aliases)], device=device)
        grp = rew.view(-1, args.G)
        adv = ((grp - grp.mean(1, keepdim=True)) / (grp.std(1, keepdim=True) + 1e-4)).view(-1, 1)

        starts = list(range(0, seq.size(0), args.micro))
        denom = mask.sum().clamp(min=1)
        for j, i in enumerate(starts):
            sl = slice(i, i + args.micro)
            ctx = model.no_sync() if j < len(starts) - 1 else contextlib.nullcontext()
            with ctx:
                lp = seq_logps(model, seq[sl], attn[sl], P)
                ratio = (lp - old[sl]).exp()
                d = rlp[sl] - lp
                loss = ((-torch.min(ratio * adv[sl], ratio.clamp(0.8, 1.2) * adv[sl])
                         + args.beta * (d.exp() - d - 1)) * mask[sl]).sum() / denom
                loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        step += 1

        stats = torch.stack([rew.mean(), (rew > 0.99).float().mean(), mask.sum(1).float().mean()])
        dist.all_reduce(stats)
        stats /= world
        wandb.log({"reward": stats[0].item(), "exact": stats[1].item(), "resp_len": stats[2].item(),
                   "grad_norm": gnorm.item(), "lr": sched.get_last_lr()[0], "gen_sec": gen_time,
                   "step_sec": time.time() - t0}, step=step)

        if step % args.save_every == 0:
            if rank == 0:
                d = os.path.join(args.out, args.run_name, f"step{step}")
                model.module.save_pretrained(d)
                tok.save_pretrained(d)
                table = wandb.Table(columns=["question", "completion", "reward"])
                for r, t, x in list(zip([r["question"] for r in rows for _ in range(args.G)], texts, rew.tolist()))[:16]:
                    table.add_data(r, t, x)
                wandb.log({"samples": table}, step=step)
            dist.barrier()

    wandb.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

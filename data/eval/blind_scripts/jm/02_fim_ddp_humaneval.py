"""Fill-in-the-middle fine-tuning with DDP, plus HumanEval pass@k at the end of each epoch.

torchrun --nproc_per_node=8 02_fim_ddp_humaneval.py --data_dir /mnt/shared/code_corpus
"""

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_linear_schedule_with_warmup

FIM_PREFIX, FIM_MIDDLE, FIM_SUFFIX = "<fim_prefix>", "<fim_middle>", "<fim_suffix>"
STOP_SEQS = ["\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#"]


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="bigcode/starcoderbase-3b")
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--out", default="/mnt/shared/runs/fim-3b")
    ap.add_argument("--seq_len", type=int, default=8192)
    ap.add_argument("--batch_size", type=int, default=1)
    ap.add_argument("--accum", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-5)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--fim_rate", type=float, default=0.5)
    ap.add_argument("--fim_spm_rate", type=float, default=0.5)
    ap.add_argument("--n_samples", type=int, default=20)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--exec_timeout", type=float, default=5.0)
    ap.add_argument("--resume", default=None)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args()


def permute_fim(ids, rng, fim_rate, spm_rate, prefix_id, middle_id, suffix_id):
    if len(ids) < 8 or rng.random() > fim_rate:
        return ids
    lo, hi = sorted(rng.integers(0, len(ids) + 1, size=2).tolist())
    prefix, middle, suffix = ids[:lo], ids[lo:hi], ids[hi:]
    if rng.random() < spm_rate:
        return [prefix_id, suffix_id] + suffix + [middle_id] + prefix + middle
    return [prefix_id] + prefix + [suffix_id] + suffix + [middle_id] + middle


def build_packed(files, tokenizer, args):
    rng = np.random.default_rng(args.seed)
    pre, mid, suf = tokenizer.convert_tokens_to_ids([FIM_PREFIX, FIM_MIDDLE, FIM_SUFFIX])
    buf = []
    for path in files:
        with open(path) as f:
            for line in f:
                code = json.loads(line)["content"]
                ids = tokenizer(code, add_special_tokens=False)["input_ids"]
                buf.extend(permute_fim(ids, rng, args.fim_rate, args.fim_spm_rate, pre, mid, suf))
                buf.append(tokenizer.eos_token_id)
    n = len(buf) // args.seq_len
    return torch.tensor(buf[: n * args.seq_len], dtype=torch.int32).view(n, args.seq_len)


def get_train_blocks(tokenizer, args, rank):
    cache = os.path.join(args.data_dir, f"packed_fim_{args.seq_len}_{args.seed}.pt")
    if rank == 0 and not os.path.exists(cache):
        files = sorted(glob.glob(os.path.join(args.data_dir, "*.jsonl")))
        blocks = build_packed(files, tokenizer, args)
        tmp = cache + ".tmp"
        torch.save(blocks, tmp)
        os.replace(tmp, cache)
    dist.barrier()
    return torch.load(cache)


def pass_at_k(n, c, k):
    if n - c < k:
        return 1.0
    return 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def truncate(text):
    cut = len(text)
    for s in STOP_SEQS:
        i = text.find(s)
        if i != -1:
            cut = min(cut, i)
    return text[:cut]


def run_sample(problem, completion, timeout):
    program = problem["prompt"] + completion + "\n\n" + problem["test"] + f"\n\ncheck({problem['entry_point']})\n"
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "prog.py")
        with open(path, "w") as f:
            f.write(program)
        try:
            r = subprocess.run([sys.executable, path], cwd=tmp, capture_output=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
    return r.returncode == 0


@torch.no_grad()
def humaneval(model, tokenizer, problems, args, rank, world_size, device):
    raw = model.module
    raw.eval()
    raw.config.use_cache = True
    local = []
    with ThreadPoolExecutor(max_workers=8) as pool:
        for prob in problems[rank::world_size]:
            enc = tokenizer(prob["prompt"], return_tensors="pt").to(device)
            out = raw.generate(
                **enc,
                do_sample=True,
                temperature=args.temperature,
                top_p=0.95,
                max_new_tokens=384,
                num_return_sequences=args.n_samples,
                pad_token_id=tokenizer.eos_token_id,
            )
            texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            oks = list(pool.map(lambda t: run_sample(prob, truncate(t), args.exec_timeout), texts))
            local.append((prob["task_id"], len(oks), sum(oks)))
    raw.config.use_cache = False
    raw.train()

    gathered = [None] * world_size
    dist.all_gather_object(gathered, local)
    rows = [r for part in gathered for r in part]
    return {f"pass@{k}": float(np.mean([pass_at_k(n, c, k) for _, n, c in rows])) for k in (1, 10)}, len(rows)


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    # rank 0 packs the corpus on the first run while the others wait at the barrier
    dist.init_process_group("nccl", timeout=timedelta(hours=2))
    rank, world_size = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.model)
    blocks = get_train_blocks(tokenizer, args, rank)
    dataset = TensorDataset(blocks)
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, num_workers=2, pin_memory=True)
    problems = list(load_dataset("openai_humaneval", split="test"))

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    total = len(loader) // args.accum * args.epochs
    sched = get_linear_schedule_with_warmup(optim, int(0.03 * total), total)

    start_epoch = 0
    if args.resume:
        state = torch.load(os.path.join(args.resume, "state.pt"), map_location=device)
        model.module.load_state_dict(state["model"])
        optim.load_state_dict(state["optim"])
        sched.load_state_dict(state["sched"])
        start_epoch = state["epoch"] + 1
        del state

    step = 0
    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for i, (ids,) in enumerate(loader):
            ids = ids.long().to(device, non_blocking=True)
            sync = (i + 1) % args.accum == 0
            if sync:
                loss = model(input_ids=ids, labels=ids).loss
                (loss / args.accum).backward()
            else:
                with model.no_sync():
                    loss = model(input_ids=ids, labels=ids).loss
                    (loss / args.accum).backward()
            if not sync:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
            step += 1
            if step % 10 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"ep {epoch} step {step}/{total} loss {l.item():.4f} lr {sched.get_last_lr()[0]:.2e}", flush=True)

        scores, n_prob = humaneval(model, tokenizer, problems, args, rank, world_size, device)
        if rank == 0:
            print(f"epoch {epoch} humaneval ({n_prob} problems): {scores}", flush=True)
            ckpt_dir = os.path.join(args.out, f"epoch{epoch}")
            os.makedirs(ckpt_dir, exist_ok=True)
            model.module.save_pretrained(ckpt_dir)
            tokenizer.save_pretrained(ckpt_dir)
            torch.save(
                {"model": model.module.state_dict(), "optim": optim.state_dict(), "sched": sched.state_dict(), "epoch": epoch},
                os.path.join(ckpt_dir, "state.pt"),
            )
            with open(os.path.join(ckpt_dir, "humaneval.json"), "w") as f:
                json.dump(scores, f)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()

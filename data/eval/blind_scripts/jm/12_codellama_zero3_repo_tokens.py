"""Repository-level continued training of CodeLlama-7B with DeepSpeed ZeRO-3.

Files of one repository are concatenated as
    <repo_name>org/repo<file_sep>path/a.py\n...code...<file_sep>path/b.py\n...
and packed into 16k-token blocks. Two new special tokens are added to the vocab.

    deepspeed --num_gpus 8 12_codellama_zero3_repo_tokens.py --repos /shared/data/repos.jsonl
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
from datasets import load_dataset
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.integrations import HfDeepSpeedConfig

NEW_TOKENS = ["<repo_name>", "<file_sep>"]


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="codellama/CodeLlama-7b-hf")
    p.add_argument("--repos", required=True)
    p.add_argument("--output_dir", default="/shared/ckpt/codellama7b-repo")
    p.add_argument("--resume_tag", default=None)
    p.add_argument("--seq_len", type=int, default=16384)
    p.add_argument("--micro_batch", type=int, default=1)
    p.add_argument("--grad_accum", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--save_steps", type=int, default=250)
    p.add_argument("--n_samples", type=int, default=5)
    p.add_argument("--local_rank", type=int, default=-1)
    p.add_argument("--seed", type=int, default=11)
    return p.parse_args()


class RepoBlocks(Dataset):
    def __init__(self, path, tok, seq_len):
        buf = []
        with open(path) as f:
            for line in f:
                repo = json.loads(line)
                text = f"<repo_name>{repo['name']}"
                for fobj in sorted(repo["files"], key=lambda x: x["path"]):
                    text += f"<file_sep>{fobj['path']}\n{fobj['content']}"
                buf.extend(tok(text, add_special_tokens=False).input_ids + [tok.eos_token_id])
        n = len(buf) // seq_len
        self.x = torch.tensor(buf[: n * seq_len], dtype=torch.long).view(n, seq_len)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i]


def pass_at_k(n, c, k):
    return 1.0 if n - c < k else 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def executes(problem, completion, timeout=5.0):
    for stop in ("\ndef ", "\nclass ", "\nif __name__", "\nprint("):
        completion = completion.split(stop)[0]
    prog = problem["prompt"] + completion + "\n" + problem["test"] + f"\ncheck({problem['entry_point']})\n"
    with tempfile.TemporaryDirectory() as d:
        fn = os.path.join(d, "p.py")
        with open(fn, "w") as f:
            f.write(prog)
        try:
            return subprocess.run([sys.executable, fn], cwd=d, capture_output=True, timeout=timeout).returncode == 0
        except subprocess.TimeoutExpired:
            return False


@torch.no_grad()
def humaneval(engine, tok, problems, n_samples, rank, world):
    """Every rank must run the same number of generate() calls under ZeRO-3, so the
    problem list is padded by wrapping around; padded entries are dropped afterwards."""
    engine.eval()
    per_rank = math.ceil(len(problems) / world)
    results = []
    for j in range(per_rank):
        idx = rank * per_rank + j
        prob = problems[idx % len(problems)]
        enc = tok(prob["prompt"], return_tensors="pt").to(engine.device)
        out = engine.module.generate(**enc, do_sample=True, temperature=0.8, top_p=0.95, max_new_tokens=384,
                                     num_return_sequences=n_samples, pad_token_id=tok.eos_token_id,
                                     synced_gpus=True, use_cache=True)
        if idx >= len(problems):
            continue
        texts = tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        results.append((idx, n_samples, sum(executes(prob, t) for t in texts)))
    engine.train()
    gathered = [None] * world
    dist.all_gather_object(gathered, results)
    rows = [r for part in gathered for r in part]
    return {k: float(np.mean([pass_at_k(n, c, k) for _, n, c in rows])) for k in (1, 5)}, len(rows)


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    tok.add_special_tokens({"additional_special_tokens": NEW_TOKENS})
    dataset = RepoBlocks(args.repos, tok, args.seq_len)
    sampler = DistributedSampler(dataset, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(dataset, batch_size=args.micro_batch, sampler=sampler, num_workers=2)
    problems = list(load_dataset("openai_humaneval", split="test"))

    steps = len(loader) // args.grad_accum * args.epochs
    ds_cfg = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": args.grad_accum,
        "train_batch_size": args.micro_batch * args.grad_accum * world,
        "bf16": {"enabled": True},
        "gradient_clipping": 1.0,
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupDecayLR",
                      "params": {"warmup_min_lr": 0, "warmup_max_lr": args.lr,
                                 "warmup_num_steps": max(1, steps // 30), "total_num_steps": steps}},
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "stage3_gather_16bit_weights_on_model_save": True,
            "stage3_param_persistence_threshold": 1e5,
        },
    }
    hf_ds = HfDeepSpeedConfig(ds_cfg)  # noqa: F841  (must stay alive for zero.Init during from_pretrained)

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16,
                                                 attn_implementation="flash_attention_2")
    old_vocab = model.config.vocab_size
    model.resize_token_embeddings(len(tok), pad_to_multiple_of=64)
    in_emb, out_emb = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    with deepspeed.zero.GatheredParameters([in_emb, out_emb], modifier_rank=0):
        if rank == 0:
            in_emb.data[old_vocab:] = in_emb.data[:old_vocab].mean(dim=0, keepdim=True)
            out_emb.data[old_vocab:] = out_emb.data[:old_vocab].mean(dim=0, keepdim=True)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False

    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_cfg)
    if args.resume_tag:
        engine.load_checkpoint(args.output_dir, tag=args.resume_tag)

    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for it, x in enumerate(loader):
            x = x.to(engine.device, non_blocking=True)
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
            if (it + 1) % args.grad_accum:
                continue
            gs = engine.global_steps
            if rank == 0 and gs % 10 == 0:
                print(f"epoch {epoch} step {gs}/{steps} loss {loss.item():.4f}", flush=True)
            if gs % args.save_steps == 0:
                engine.save_checkpoint(args.output_dir, tag=f"global_step{gs}")

        scores, n = humaneval(engine, tok, problems, args.n_samples, rank, world)
        if rank == 0:
            print(f"epoch {epoch} HumanEval ({n} problems) pass@1={scores[1]:.4f} pass@5={scores[5]:.4f}", flush=True)

    final = os.path.join(args.output_dir, "hf")
    engine.save_16bit_model(final, "pytorch_model.bin")
    if rank == 0:
        engine.module.config.save_pretrained(final)
        tok.save_pretrained(final)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""CodeLlama-13B-Python instruction tuning with DeepSpeed ZeRO-3.

Instruction data is mined from repositories (docstring / issue -> implementation) and
tagged with the repository's language; two new special tokens delimit the test block
that some records carry. Evaluation samples n completions per HumanEval problem on every
rank (ZeRO-3 needs all ranks in each forward, hence synced_gpus), executes them in a
sandbox and computes unbiased pass@k over the whole benchmark.

    deepspeed --num_gpus 8 17_ds_zero3_codellama13b_passk.py --data data/repo_instruct_py.jsonl
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
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.integrations import HfDeepSpeedConfig

NEW_TOKENS = ["<tests>", "</tests>"]


def parse():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="codellama/CodeLlama-13b-Python-hf")
    p.add_argument("--data", required=True)
    p.add_argument("--humaneval", default="data/HumanEval.jsonl")
    p.add_argument("--ckpt_dir", default="/shared/ckpt/cl13b-repo-z3")
    p.add_argument("--max_len", type=int, default=2048)
    p.add_argument("--micro_bs", type=int, default=2)
    p.add_argument("--global_bs", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--n_samples", type=int, default=5)
    p.add_argument("--timeout", type=float, default=8.0)
    p.add_argument("--local_rank", type=int, default=-1)
    return p.parse_args()


def build_ds_config(args, world, total_steps):
    accum = args.global_bs // (args.micro_bs * world)
    assert accum >= 1 and accum * args.micro_bs * world == args.global_bs
    return {
        "train_batch_size": args.global_bs,
        "train_micro_batch_size_per_gpu": args.micro_bs,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.95], "eps": 1e-8,
                                                  "weight_decay": 0.0}},
        "scheduler": {"type": "WarmupCosineLR",
                      "params": {"total_num_steps": total_steps, "warmup_num_steps": max(1, total_steps // 33)}},
        "zero_optimization": {
            "stage": 3,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "sub_group_size": 1e9,
            "stage3_max_live_parameters": 1e9,
            "stage3_max_reuse_distance": 1e9,
            "stage3_gather_16bit_weights_on_model_save": True,
        },
        "steps_per_print": 100,
    }


class InstructionRecords(Dataset):
    def __init__(self, path, tok, max_len):
        self.items = []
        with open(path) as f:
            for line in f:
                r = json.loads(line)
                src = f"# {r['repo']}\n# {r['instruction']}\n"
                if r.get("tests"):
                    src += f"<tests>\n{r['tests']}\n</tests>\n"
                a = tok(src)["input_ids"]
                b = tok(r["code"], add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
                if len(a) + len(b) <= max_len:
                    self.items.append((a, b))

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        a, b = self.items[i]
        return torch.tensor(a + b), torch.tensor([-100] * len(a) + b)


class PadCollate:
    def __init__(self, pad_id):
        self.pad_id = pad_id

    def __call__(self, batch):
        L = max(x.numel() for x, _ in batch)
        ids = torch.full((len(batch), L), self.pad_id, dtype=torch.long)
        lab = torch.full((len(batch), L), -100, dtype=torch.long)
        att = torch.zeros((len(batch), L), dtype=torch.long)
        for i, (x, y) in enumerate(batch):
            ids[i, :x.numel()], lab[i, :y.numel()], att[i, :x.numel()] = x, y, 1
        return ids, lab, att


def pass_at_k(n, c, k):
    return 1.0 if n - c < k else 1.0 - float(np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def execute(program, timeout):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "x.py")
        with open(path, "w") as f:
            f.write(program)
        try:
            return subprocess.run([sys.executable, path], cwd=d, capture_output=True,
                                  timeout=timeout).returncode == 0
        except subprocess.TimeoutExpired:
            return False


@torch.no_grad()
def evaluate_passk(engine, tok, problems, args, rank, world, device):
    engine.eval()
    n_per_rank = math.ceil(len(problems) / world)
    order = list(range(rank, len(problems), world))
    # every rank must run the same number of generate() calls under ZeRO-3
    order += [order[0]] * (n_per_rank - len(order))
    counts = {}
    for i in order:
        prob = problems[i]
        enc = tok(prob["prompt"], return_tensors="pt").to(device)
        out = engine.module.generate(**enc, do_sample=True, temperature=0.8, top_p=0.95, max_new_tokens=384,
                                     num_return_sequences=args.n_samples, synced_gpus=True,
                                     pad_token_id=tok.pad_token_id)
        ok = 0
        for text in tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True):
            text = text.split("\ndef ")[0].split("\nclass ")[0].split("\nif __name__")[0]
            ok += execute(prob["prompt"] + text + "\n\n" + prob["test"] + f"\ncheck({prob['entry_point']})\n",
                          args.timeout)
        counts[prob["task_id"]] = ok
    all_counts = [None] * world
    dist.all_gather_object(all_counts, counts)
    merged = {}
    for c in all_counts:
        merged.update(c)
    engine.train()
    return {f"pass@{k}": float(np.mean([pass_at_k(args.n_samples, c, k) for c in merged.values()]))
            for k in (1, args.n_samples)}


def main():
    args = parse()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    deepspeed.init_distributed(dist_backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)

    tok = AutoTokenizer.from_pretrained(args.model)
    added = tok.add_special_tokens({"additional_special_tokens": NEW_TOKENS})
    tok.pad_token = tok.unk_token

    data = InstructionRecords(args.data, tok, args.max_len)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=1)
    loader = DataLoader(data, batch_size=args.micro_bs, sampler=sampler, collate_fn=PadCollate(tok.pad_token_id),
                        num_workers=2, drop_last=True)
    accum = args.global_bs // (args.micro_bs * world)
    total_steps = (len(loader) // accum) * args.epochs
    ds_config = build_ds_config(args, world, total_steps)
    hf_ds = HfDeepSpeedConfig(ds_config)  # keep this object alive

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16)
    model.resize_token_embeddings(len(tok), pad_to_multiple_of=64)
    if added:
        in_emb = model.get_input_embeddings().weight
        out_emb = model.get_output_embeddings().weight
        with deepspeed.zero.GatheredParameters([in_emb, out_emb], modifier_rank=0):
            if rank == 0:
                n_old = len(tok) - added
                in_emb.data[n_old:len(tok)] = in_emb.data[:n_old].mean(0, keepdim=True)
                out_emb.data[n_old:len(tok)] = out_emb.data[:n_old].mean(0, keepdim=True)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False

    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters()],
                                           config=ds_config)
    start_epoch = 0
    _, client = engine.load_checkpoint(args.ckpt_dir)  # (None, None) when there is no 'latest' yet
    if client:
        start_epoch = client["epoch"] + 1

    with open(args.humaneval) as f:
        problems = [json.loads(l) for l in f]

    for epoch in range(start_epoch, args.epochs):
        sampler.set_epoch(epoch)
        engine.train()
        running = torch.zeros(2, device=device)
        for it, (ids, lab, att) in enumerate(loader):
            if it >= (len(loader) // accum) * accum:
                break
            loss = engine(input_ids=ids.to(device), attention_mask=att.to(device), labels=lab.to(device)).loss
            engine.backward(loss)
            engine.step()
            running += torch.stack([loss.detach().float(), torch.ones((), device=device)])
            if (it + 1) % (accum * 20) == 0:
                dist.all_reduce(running)
                if rank == 0:
                    print(f"epoch {epoch} step {engine.global_steps} loss {(running[0] / running[1]).item():.4f}",
                          flush=True)
                running.zero_()

        model.config.use_cache = True
        metrics = evaluate_passk(engine, tok, problems, args, rank, world, device)
        model.config.use_cache = False
        if rank == 0:
            print(f"epoch {epoch}: {metrics}", flush=True)
        engine.save_checkpoint(args.ckpt_dir, tag=f"epoch{epoch}", client_state={"epoch": epoch, **metrics})
        export = os.path.join(args.ckpt_dir, f"hf-epoch{epoch}")
        engine.save_16bit_model(export)
        if rank == 0:
            tok.save_pretrained(export)
            model.config.save_pretrained(export)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()

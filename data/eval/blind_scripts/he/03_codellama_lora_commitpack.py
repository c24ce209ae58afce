"""LoRA instruction tuning of CodeLlama-7B on commit-derived instructions
(commit message + pre-change file -> post-change function), evaluated on MBPP
by executing the generated function against the task's assert statements.

    torchrun --nnodes=1 --nproc_per_node=8 03_codellama_lora_commitpack.py \
        --train_file data/commitpack_py.jsonl --mbpp_file data/mbpp_test.jsonl
"""
import argparse
import json
import logging
import math
import os
import subprocess
import sys
import tempfile
from functools import partial

import torch
import torch.distributed as dist
from peft import LoraConfig, get_peft_model
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup

logger = logging.getLogger("lora_commit")

SYSTEM = "You are an expert Python programmer."
TEMPLATE = "[INST] <<SYS>>\n{system}\n<</SYS>>\n\n{instruction} [/INST]\n"


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base_model", default="codellama/CodeLlama-7b-hf")
    ap.add_argument("--train_file", required=True)
    ap.add_argument("--mbpp_file", required=True)
    ap.add_argument("--output_dir", default="out/codellama-lora-commit")
    ap.add_argument("--lora_r", type=int, default=16)
    ap.add_argument("--lora_alpha", type=int, default=32)
    ap.add_argument("--lora_dropout", type=float, default=0.05)
    ap.add_argument("--max_seq_len", type=int, default=2048)
    ap.add_argument("--per_device_batch", type=int, default=2)
    ap.add_argument("--grad_accum", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--num_epochs", type=int, default=2)
    ap.add_argument("--warmup_steps", type=int, default=100)
    ap.add_argument("--eval_batch", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=6.0)
    return ap.parse_args()


class CommitInstructions(Dataset):
    def __init__(self, path, tok, max_len):
        self.samples = []
        with open(path) as fh:
            for line in fh:
                row = json.loads(line)
                instr = f"{row['message'].strip()}\n\n```python\n{row['old_contents']}\n```"
                prompt = TEMPLATE.format(system=SYSTEM, instruction=instr)
                target = f"```python\n{row['new_contents']}\n```" + tok.eos_token
                p = tok(prompt, add_special_tokens=True)["input_ids"]
                t = tok(target, add_special_tokens=False)["input_ids"]
                if len(p) + len(t) > max_len:
                    continue
                self.samples.append((p + t, [-100] * len(p) + t))

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        return self.samples[i]


def pad_batch(batch, pad_id):
    width = max(len(x) for x, _ in batch)
    input_ids, labels, mask = [], [], []
    for x, y in batch:
        n = width - len(x)
        input_ids.append(x + [pad_id] * n)
        labels.append(y + [-100] * n)
        mask.append([1] * len(x) + [0] * n)
    return torch.tensor(input_ids), torch.tensor(labels), torch.tensor(mask)


def run_asserts(code, tests, timeout):
    src = code + "\n\n" + "\n".join(tests) + "\n"
    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as fh:
        fh.write(src)
        path = fh.name
    try:
        res = subprocess.run([sys.executable, path], capture_output=True, timeout=timeout)
        return res.returncode == 0
    except subprocess.TimeoutExpired:
        return False
    finally:
        os.unlink(path)


def extract_code(text):
    if "```python" in text:
        text = text.split("```python", 1)[1]
    return text.split("```", 1)[0]


@torch.no_grad()
def eval_mbpp(peft_model, tok, tasks, args, rank, world, device):
    peft_model.eval()
    tok.padding_side = "left"
    mine = tasks[rank::world]
    results = []
    for start in range(0, len(mine), args.eval_batch):
        chunk = mine[start:start + args.eval_batch]
        prompts = [TEMPLATE.format(system=SYSTEM, instruction=f"{t['text']}\nYour code should pass these tests:\n"
                                   + "\n".join(t["test_list"])) for t in chunk]
        enc = tok(prompts, return_tensors="pt", padding=True).to(device)
        gen = peft_model.generate(**enc, max_new_tokens=512, do_sample=False, pad_token_id=tok.pad_token_id)
        for t, row in zip(chunk, gen[:, enc["input_ids"].shape[1]:]):
            code = extract_code(tok.decode(row, skip_special_tokens=True))
            results.append(run_asserts(code, t["test_list"], args.timeout))
    tok.padding_side = "right"
    peft_model.train()
    counts = torch.tensor([sum(results), len(results)], dtype=torch.float64, device=device)
    dist.all_reduce(counts)
    return (counts[0] / counts[1]).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(message)s")

    tok = AutoTokenizer.from_pretrained(args.base_model)
    tok.pad_token = tok.unk_token

    model = AutoModelForCausalLM.from_pretrained(args.base_model, torch_dtype=torch.bfloat16)
    model.gradient_checkpointing_enable()
    model.enable_input_require_grads()
    lora_cfg = LoraConfig(r=args.lora_r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout,
                          target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], task_type="CAUSAL_LM")
    model = get_peft_model(model, lora_cfg)
    if rank == 0:
        model.print_trainable_parameters()
    model.to(device)
    ddp_model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    train_ds = CommitInstructions(args.train_file, tok, args.max_seq_len)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=17)
    loader = DataLoader(train_ds, batch_size=args.per_device_batch, sampler=sampler, num_workers=2,
                        collate_fn=partial(pad_batch, pad_id=tok.pad_token_id), drop_last=True)
    with open(args.mbpp_file) as fh:
        tasks = [json.loads(l) for l in fh]

    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=args.lr, weight_decay=0.0)
    updates_per_epoch = len(loader) // args.grad_accum
    total_updates = updates_per_epoch * args.num_epochs
    scheduler = get_cosine_schedule_with_warmup(optimizer, args.warmup_steps, total_updates)
    logger.info("examples=%d world=%d updates=%d", len(train_ds), world, total_updates)

    update = 0
    for epoch in range(args.num_epochs):
        sampler.set_epoch(epoch)
        ddp_model.train()
        acc_loss = torch.zeros((), device=device)
        for it, (ids, labels, mask) in enumerate(loader):
            if it >= updates_per_epoch * args.grad_accum:
                break
            out = ddp_model(input_ids=ids.to(device), attention_mask=mask.to(device), labels=labels.to(device))
            (out.loss / args.grad_accum).backward()
            acc_loss += out.loss.detach() / args.grad_accum
            if (it + 1) % args.grad_accum:
                continue
            torch.nn.utils.clip_grad_norm_(trainable, 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            update += 1
            if update % 10 == 0:
                dist.all_reduce(acc_loss, op=dist.ReduceOp.AVG)
                logger.info("epoch %d update %d/%d loss %.4f", epoch, update, total_updates, acc_loss.item())
            acc_loss.zero_()

        acc = eval_mbpp(model, tok, tasks, args, rank, world, device)
        logger.info("epoch %d MBPP pass@1 %.4f", epoch, acc)
        if rank == 0:
            save_to = os.path.join(args.output_dir, f"epoch{epoch}")
            model.save_pretrained(save_to)
            tok.save_pretrained(save_to)
            with open(os.path.join(save_to, "mbpp.json"), "w") as fh:
                json.dump({"epoch": epoch, "pass@1": acc}, fh)
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()

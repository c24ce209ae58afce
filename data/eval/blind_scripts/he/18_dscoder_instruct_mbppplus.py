"""Continue instruction tuning deepseek-coder-1.3b-instruct on repository-grounded
Q&A (questions asked about a repo's code, answered with code that runs against the
repo's own tests). Evaluated with MBPP+ (base + extra tests) pass@1, greedy.

    torchrun --nproc_per_node=8 18_dscoder_instruct_mbppplus.py --data_dir data/repo_qa_hf
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
from datasets import load_from_disk
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from transformers import AutoModelForCausalLM, AutoTokenizer, get_cosine_schedule_with_warmup


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="deepseek-ai/deepseek-coder-1.3b-instruct")
    ap.add_argument("--data_dir", required=True, help="datasets.save_to_disk output with a 'messages' column")
    ap.add_argument("--mbppplus", default="data/MbppPlus.jsonl")
    ap.add_argument("--out", default="ckpt/dsc13b-repoqa")
    ap.add_argument("--max_len", type=int, default=2048)
    ap.add_argument("--bs", type=int, default=4)
    ap.add_argument("--accum", type=int, default=4)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=20.0)
    return ap.parse_args()


def encode_chat(tok, messages, max_len):
    """Tokenize a chat; only assistant turns contribute to the loss."""
    ids, labels = [], []
    for i, m in enumerate(messages):
        prefix = tok.apply_chat_template(messages[:i + 1], tokenize=False)
        prev = tok.apply_chat_template(messages[:i], tokenize=False) if i else ""
        piece = tok(prefix[len(prev):], add_special_tokens=False)["input_ids"]
        ids += piece
        labels += piece if m["role"] == "assistant" else [-100] * len(piece)
    return ids[:max_len], labels[:max_len]


class ChatCollator:
    def __init__(self, tok, max_len):
        self.tok, self.max_len = tok, max_len

    def __call__(self, rows):
        enc = [encode_chat(self.tok, r["messages"], self.max_len) for r in rows]
        L = max(len(x) for x, _ in enc)
        pad = self.tok.pad_token_id
        ids = torch.tensor([x + [pad] * (L - len(x)) for x, _ in enc])
        lab = torch.tensor([y + [-100] * (L - len(y)) for _, y in enc])
        att = torch.tensor([[1] * len(x) + [0] * (L - len(x)) for x, _ in enc])
        return ids, lab, att


def passes(code, test_code, entry, timeout):
    prog = code + "\n\n" + test_code + "\n"
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "eval_prog.py")
        with open(path, "w") as f:
            f.write(prog)
        try:
            p = subprocess.run([sys.executable, path], cwd=d, capture_output=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return False
    return p.returncode == 0


def first_code_block(text):
    if "```" not in text:
        return text
    block = text.split("```", 2)[1]
    return block[len("python"):] if block.startswith("python") else block


@torch.no_grad()
def mbppplus_pass1(model, tok, tasks, rank, world, device, timeout):
    model.eval()
    n_ok = n = 0
    for t in tasks[rank::world]:
        msgs = [{"role": "user", "content": f"{t['prompt']}\n```python\n{t['test_list'][0]}\n```"}]
        enc = tok.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt").to(device)
        out = model.generate(enc, max_new_tokens=512, do_sample=False, eos_token_id=tok.eos_token_id,
                             pad_token_id=tok.pad_token_id)
        code = first_code_block(tok.decode(out[0, enc.shape[1]:], skip_special_tokens=True))
        n_ok += passes(code, t["test"], t["entry_point"], timeout)
        n += 1
    stats = torch.tensor([n_ok, n], dtype=torch.float64, device=device)
    dist.all_reduce(stats)
    model.train()
    return (stats[0] / stats[1]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    torch.manual_seed(42)

    tok = AutoTokenizer.from_pretrained(args.model)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    train_ds = load_from_disk(args.data_dir)["train"]
    loader = DataLoader(train_ds, batch_size=args.bs, shuffle=True, collate_fn=ChatCollator(tok, args.max_len),
                        num_workers=6, pin_memory=True, drop_last=True, persistent_workers=True)
    with open(args.mbppplus) as f:
        tasks = [json.loads(l) for l in f]

    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.bfloat16).to(device)
    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    updates = (len(loader) // args.accum) * args.epochs
    sched = get_cosine_schedule_with_warmup(opt, int(0.05 * updates), updates)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{len(train_ds)} conversations; {updates} optimizer updates on {world} GPUs", flush=True)

    best, update = -1.0, 0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        acc_loss = torch.zeros((), device=device)
        for i, (ids, lab, att) in enumerate(loader):
            if i >= (len(loader) // args.accum) * args.accum:
                break
            ids, lab, att = ids.to(device), lab.to(device), att.to(device)
            if (i + 1) % args.accum != 0:
                with model.no_sync():
                    loss = model(input_ids=ids, attention_mask=att, labels=lab).loss / args.accum
                    loss.backward()
                acc_loss += loss.detach()
                continue
            loss = model(input_ids=ids, attention_mask=att, labels=lab).loss / args.accum
            loss.backward()
            acc_loss += loss.detach()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            update += 1
            if update % 20 == 0:
                dist.all_reduce(acc_loss, op=dist.ReduceOp.AVG)
                if rank == 0:
                    print(f"epoch {epoch} update {update}/{updates} loss {acc_loss.item():.4f} "
                          f"({time.time() - t0:.0f}s)", flush=True)
            acc_loss.zero_()

        score = mbppplus_pass1(model.module, tok, tasks, rank, world, device, args.timeout)
        if rank == 0:
            print(f"epoch {epoch}: MBPP+ pass@1 {score:.4f}", flush=True)
            if score > best:
                best = score
                model.module.save_pretrained(os.path.join(args.out, "best"))
                tok.save_pretrained(os.path.join(args.out, "best"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()

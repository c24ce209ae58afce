"""Joint fine-tune: code LM + a small "does this solution pass its tests" verifier head.

Reference solutions train the LM only; sampled solutions that were executed against
the unit tests also train the verifier (label 1 = passed).

    torchrun --nproc_per_node=4 09_codegen_verifier_aux.py --train data/mixed_train.jsonl --val data/mixed_val.jsonl
"""
import argparse
import json
import os
import random
from functools import partial

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoModelForCausalLM, AutoTokenizer, get_linear_schedule_with_warmup


def get_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="deepseek-ai/deepseek-coder-1.3b-base")
    ap.add_argument("--train", required=True)
    ap.add_argument("--val", required=True)
    ap.add_argument("--out", default="ckpt/lm-verifier")
    ap.add_argument("--max_len", type=int, default=4096)
    ap.add_argument("--bs", type=int, default=2)
    ap.add_argument("--accum", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-5)
    ap.add_argument("--head_lr", type=float, default=1e-4)
    ap.add_argument("--aux_weight", type=float, default=0.5)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--seed", type=int, default=3)
    return ap.parse_args()


class MixedSolutions(Dataset):
    def __init__(self, path, tok, max_len):
        self.rows = []
        with open(path) as f:
            for line in f:
                ex = json.loads(line)
                p = tok(ex["prompt"], add_special_tokens=True)["input_ids"]
                s = tok(ex["solution"] + tok.eos_token, add_special_tokens=False)["input_ids"]
                ids = (p + s)[:max_len]
                passed = ex.get("passed")  # None for reference solutions
                train_lm = passed is None or passed
                labels = ([-100] * len(p) + (s if train_lm else [-100] * len(s)))[:max_len]
                exec_label = -1 if passed is None else int(passed)
                self.rows.append((ids, labels, exec_label))

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def collate(batch, pad_id):
    L = max(len(b[0]) for b in batch)
    ids = torch.full((len(batch), L), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), L), -100, dtype=torch.long)
    mask = torch.zeros((len(batch), L), dtype=torch.long)
    for i, (x, y, _) in enumerate(batch):
        ids[i, : len(x)] = torch.tensor(x)
        labels[i, : len(y)] = torch.tensor(y)
        mask[i, : len(x)] = 1
    exec_label = torch.tensor([b[2] for b in batch], dtype=torch.long)
    return ids, mask, labels, exec_label


class CodeLMWithVerifier(nn.Module):
    def __init__(self, name, aux_weight):
        super().__init__()
        self.lm = AutoModelForCausalLM.from_pretrained(name, torch_dtype=torch.bfloat16)
        h = self.lm.config.hidden_size
        self.verifier = nn.Sequential(nn.Linear(h, h // 4), nn.GELU(), nn.Linear(h // 4, 1))
        self.aux_weight = aux_weight

    def forward(self, ids, mask, labels, exec_label):
        out = self.lm(input_ids=ids, attention_mask=mask, labels=labels, output_hidden_states=True)
        lm_loss = out.loss if torch.isfinite(out.loss) else out.logits.sum() * 0.0
        has_label = exec_label >= 0
        if not has_label.any():
            return lm_loss, None, None
        last = mask.sum(dim=1) - 1
        hid = out.hidden_states[-1][torch.arange(ids.size(0), device=ids.device), last]
        logits = self.verifier(hid[has_label].float()).squeeze(-1)
        target = exec_label[has_label].float()
        v_loss = F.binary_cross_entropy_with_logits(logits, target)
        correct = ((logits > 0).float() == target).sum()
        return lm_loss + self.aux_weight * v_loss, correct, has_label.sum()


@torch.no_grad()
def evaluate(net, loader, device):
    net.eval()
    acc = torch.zeros(4, device=device)  # lm loss sum, batches, verifier correct, verifier n
    for ids, mask, labels, exec_label in loader:
        ids, mask, labels, exec_label = (t.to(device) for t in (ids, mask, labels, exec_label))
        out = net.lm(input_ids=ids, attention_mask=mask, labels=labels)
        if torch.isfinite(out.loss):
            acc[0] += out.loss.float()
            acc[1] += 1
        _, correct, n = net(ids, mask, labels, exec_label)
        if n is not None:
            acc[2] += correct
            acc[3] += n
    dist.all_reduce(acc)
    net.train()
    return (acc[0] / acc[1].clamp(min=1)).item(), (acc[2] / acc[3].clamp(min=1)).item()


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    tok = AutoTokenizer.from_pretrained(args.model)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    pad = tok.pad_token_id
    train_ds = MixedSolutions(args.train, tok, args.max_len)
    val_ds = MixedSolutions(args.val, tok, args.max_len)
    sampler = DistributedSampler(train_ds, shuffle=True, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=args.bs, sampler=sampler, num_workers=2,
                          collate_fn=partial(collate, pad_id=pad))
    val_idx = list(range(rank, len(val_ds), world))
    val_dl = DataLoader(torch.utils.data.Subset(val_ds, val_idx), batch_size=args.bs,
                        collate_fn=partial(collate, pad_id=pad))

    net = CodeLMWithVerifier(args.model, args.aux_weight)
    net.lm.gradient_checkpointing_enable()
    net.lm.config.use_cache = False
    net.to(device)
    # batches without executed samples never touch the verifier head
    model = DDP(net, device_ids=[local_rank], find_unused_parameters=True)

    optim = torch.optim.AdamW([
        {"params": net.lm.parameters(), "lr": args.lr, "weight_decay": 0.0},
        {"params": net.verifier.parameters(), "lr": args.head_lr, "weight_decay": 0.01},
    ])
    total = len(train_dl) // args.accum * args.epochs
    sched = get_linear_schedule_with_warmup(optim, int(0.05 * total), total)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        for i, (ids, mask, labels, exec_label) in enumerate(train_dl):
            ids, mask, labels, exec_label = (t.to(device, non_blocking=True) for t in (ids, mask, labels, exec_label))
            boundary = (i + 1) % args.accum == 0
            model.require_backward_grad_sync = boundary
            loss, _, _ = model(ids, mask, labels, exec_label)
            (loss / args.accum).backward()
            if not boundary:
                continue
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            sched.step()
            optim.zero_grad(set_to_none=True)
            step += 1
            if rank == 0 and step % 20 == 0:
                print(f"epoch {epoch} step {step}/{total} loss {loss.item():.4f}", flush=True)

        val_lm, val_acc = evaluate(net, val_dl, device)
        if rank == 0:
            print(f"epoch {epoch}: val lm loss {val_lm:.4f} verifier acc {val_acc:.3f}", flush=True)
            out_dir = os.path.join(args.out, f"epoch{epoch}")
            os.makedirs(out_dir, exist_ok=True)
            net.lm.save_pretrained(out_dir)
            tok.save_pretrained(out_dir)
            torch.save(net.verifier.state_dict(), os.path.join(out_dir, "verifier.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()

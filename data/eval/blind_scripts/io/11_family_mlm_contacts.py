"""Domain-adaptive MLM fine-tuning of ESM-2 on one protein family (e.g. Pfam PF00072 members),
tracking unsupervised contact precision on the family's structures as training goes on.

The contact predictor is ESM's logistic regression over attention maps
(`predict_contacts`); it stays frozen, so a drop in precision means the attention
maps themselves drifted.

    torchrun --nproc_per_node=4 11_family_mlm_contacts.py --family_fasta data/PF00072.fasta \
        --structures data/PF00072_pdb.pt --output_dir runs/pf00072
"""
import argparse
import logging
import math
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import (DataCollatorForLanguageModeling, EsmForMaskedLM, EsmTokenizer,
                          get_linear_schedule_with_warmup)

logger = logging.getLogger(__name__)


def parse_args():
    ap = argparse.ArgumentParser()
    ap.add_argument("--family_fasta", required=True)
    ap.add_argument("--structures", required=True, help="torch file: list of {seq, contacts} dicts")
    ap.add_argument("--model_name", default="facebook/esm2_t12_35M_UR50D")
    ap.add_argument("--max_len", type=int, default=512)
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--eval_every", type=int, default=500)
    ap.add_argument("--output_dir", required=True)
    return ap.parse_args()


def read_fasta(path):
    out, cur = [], []
    for line in open(path):
        line = line.strip()
        if line.startswith(">"):
            if cur:
                out.append("".join(cur))
            cur = []
        elif line:
            cur.append(line.upper().replace("-", "").replace(".", ""))
    if cur:
        out.append("".join(cur))
    return out


class FamilySequences(Dataset):
    def __init__(self, seqs, tokenizer, max_len):
        self.seqs, self.tok, self.max_len = seqs, tokenizer, max_len

    def __len__(self):
        return len(self.seqs)

    def __getitem__(self, i):
        return self.tok(self.seqs[i], truncation=True, max_length=self.max_len,
                        return_special_tokens_mask=True)


@torch.no_grad()
def contact_precision(model, tokenizer, structures, device, rank, world, min_sep=24):
    """Long-range precision at L/5 and L over this rank's share of the structures, summed over ranks."""
    model.eval()
    sums = torch.zeros(3, device=device, dtype=torch.float64)   # P@L/5, P@L, n
    for item in structures[rank::world]:
        enc = tokenizer(item["seq"], return_tensors="pt").to(device)
        probs = model.predict_contacts(enc["input_ids"], enc["attention_mask"])[0].float()
        target = item["contacts"].to(device)
        L = target.shape[0]
        i, j = torch.triu_indices(L, L, min_sep, device=device)
        valid = target[i, j] >= 0
        p, t = probs[i, j][valid], target[i, j][valid]
        if p.numel() == 0:
            continue
        order = p.argsort(descending=True)
        sums[0] += t[order[:max(1, L // 5)]].float().mean()
        sums[1] += t[order[:L]].float().mean()
        sums[2] += 1
    dist.all_reduce(sums)
    model.train()
    return (sums[0] / sums[2]).item(), (sums[1] / sums[2]).item()


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="%(asctime)s [%(levelname)s] %(message)s")

    tokenizer = EsmTokenizer.from_pretrained(args.model_name)
    model = EsmForMaskedLM.from_pretrained(args.model_name)
    model.esm.contact_head.requires_grad_(False)
    model.to(device)
    model = DDP(model, device_ids=[local_rank])

    seqs = read_fasta(args.family_fasta)
    structures = torch.load(args.structures, map_location="cpu")
    dataset = FamilySequences(seqs, tokenizer, args.max_len)
    sampler = DistributedSampler(dataset, shuffle=True, drop_last=True)
    collator = DataCollatorForLanguageModeling(tokenizer, mlm_probability=0.15)
    loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, collate_fn=collator,
                        num_workers=4, pin_memory=True, drop_last=True)

    no_decay = ("bias", "LayerNorm.weight", "layer_norm.weight")
    groups = [
        {"params": [p for n, p in model.named_parameters() if p.requires_grad and not any(k in n for k in no_decay)],
         "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if p.requires_grad and any(k in n for k in no_decay)],
         "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=args.lr)
    total = args.epochs * len(loader)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.06 * total), total)

    p5, pl = contact_precision(model, tokenizer, structures, device, rank, world)
    logger.info("before fine-tuning: P@L/5 %.4f  P@L %.4f", p5, pl)
    if rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)

    step = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        for batch in loader:
            batch = {k: v.to(device) for k, v in batch.items()}
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % 50 == 0:
                l = loss.detach().clone()
                dist.all_reduce(l, op=dist.ReduceOp.AVG)
                logger.info("epoch %d step %d mlm loss %.4f ppl %.2f", epoch, step, l.item(), math.exp(l.item()))
            if step % args.eval_every == 0:
                p5, pl = contact_precision(model, tokenizer, structures, device, rank, world)
                logger.info("step %d: contact P@L/5 %.4f  P@L %.4f", step, p5, pl)
                if rank == 0:
                    model.module.save_pretrained(os.path.join(args.output_dir, f"step_{step}"))
                dist.barrier()

    if rank == 0:
        model.module.save_pretrained(os.path.join(args.output_dir, "final"))
        tokenizer.save_pretrained(os.path.join(args.output_dir, "final"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

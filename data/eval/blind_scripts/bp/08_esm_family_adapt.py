"""Continue masked-LM training of ESM-2 on one protein family (domain adaptation).

We track, besides MLM perplexity on held-out family members, the unsupervised
long-range contact precision of ESM's regression contact head on a few family
members with known structures (the head is kept frozen).

    torchrun --standalone --nproc_per_node=4 08_esm_family_adapt.py \
        --family_fasta data/PF00069_members.fasta --structures data/PF00069_pdb.npz
"""
import argparse
import os
import random

import esm
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from Bio import SeqIO
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler


def parse_args():
    p = argparse.ArgumentParser()
    p.add_argument("--family_fasta", required=True)
    p.add_argument("--structures", required=True, help="npz: names, seqs, contact maps (object arrays)")
    p.add_argument("--model", default="esm2_t30_150M_UR50D")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--max_len", type=int, default=1022)
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--holdout", type=float, default=0.05)
    p.add_argument("--out", default="runs/family_adapt")
    return p.parse_args()


def mask_tokens(tokens, alphabet, p=0.15):
    labels = tokens.clone()
    special = (tokens == alphabet.padding_idx) | (tokens == alphabet.cls_idx) | (tokens == alphabet.eos_idx)
    sel = (torch.rand_like(tokens, dtype=torch.float) < p) & ~special
    labels[~sel] = -100
    noisy = tokens.clone()
    r = torch.rand_like(tokens, dtype=torch.float)
    noisy[sel & (r < 0.8)] = alphabet.mask_idx
    rand_aa = sel & (r >= 0.8) & (r < 0.9)
    noisy[rand_aa] = torch.randint(4, 24, (int(rand_aa.sum()),), device=tokens.device)
    return noisy, labels


def precision_at_l(contacts, true, min_sep=24):
    L = true.shape[0]
    i, j = np.triu_indices(L, k=min_sep)
    scores = contacts[i, j]
    top = np.argsort(-scores)[:L]
    return float(true[i[top], j[top]].mean())


def main():
    args = parse_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    device = torch.device("cuda", local_rank)

    model, alphabet = esm.pretrained.load_model_and_alphabet(args.model)
    model = model.to(device)
    for p in model.contact_head.parameters():
        p.requires_grad_(False)
    batch_converter = alphabet.get_batch_converter(truncation_seq_length=args.max_len)

    records = [(r.id, str(r.seq).replace("-", "").upper()) for r in SeqIO.parse(args.family_fasta, "fasta")]
    random.Random(0).shuffle(records)
    n_hold = max(1, int(args.holdout * len(records)))
    held, train = records[:n_hold], records[n_hold:]

    struct = np.load(args.structures, allow_pickle=True)
    struct_items = list(zip(struct["names"], struct["seqs"], struct["contacts"]))

    train_sampler = DistributedSampler(train, shuffle=True, seed=0)
    train_loader = DataLoader(train, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=batch_converter, num_workers=2)
    held_loader = DataLoader(held, batch_size=args.batch_size, sampler=DistributedSampler(held, shuffle=False),
                             collate_fn=batch_converter)

    model = DDP(model, device_ids=[local_rank])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=args.lr, weight_decay=0.01)
    os.makedirs(args.out, exist_ok=True)

    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for it, (_, _, tokens) in enumerate(train_loader):
            tokens = tokens.to(device, non_blocking=True)
            noisy, labels = mask_tokens(tokens, alphabet)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(noisy)["logits"]
            loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), labels.view(-1), ignore_index=-100)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            if rank == 0 and it % 50 == 0:
                print(f"epoch {epoch} it {it} mlm {loss.item():.4f}", flush=True)

        model.eval()
        tot = torch.zeros(2, device=device)
        with torch.no_grad():
            for _, _, tokens in held_loader:
                tokens = tokens.to(device)
                torch.manual_seed(1234)
                noisy, labels = mask_tokens(tokens, alphabet)
                logits = model(noisy)["logits"].float()
                m = labels != -100
                tot[0] += F.cross_entropy(logits[m], labels[m], reduction="sum")
                tot[1] += m.sum()
        dist.all_reduce(tot)

        if rank == 0:
            precs = []
            with torch.no_grad():
                for name, seq, cmap in struct_items:
                    _, _, toks = batch_converter([(name, seq)])
                    contacts = model.predict_contacts(toks.to(device))[0].float().cpu().numpy()
                    precs.append(precision_at_l(contacts, cmap))
            ppl = torch.exp(tot[0] / tot[1]).item()
            print(f"epoch {epoch}: held-out ppl {ppl:.3f}  long-range P@L {np.mean(precs):.4f}", flush=True)
            torch.save({"model": model.module.state_dict(), "epoch": epoch, "args": vars(args)},
                       os.path.join(args.out, f"epoch{epoch}.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()

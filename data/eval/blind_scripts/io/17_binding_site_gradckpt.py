"""Per-residue ligand-binding site prediction (BioLiP) by fine-tuning ESM-2 650M.

Full chains up to 1024 residues are used (binding sites depend on distal residues),
so activation memory is cut with gradient checkpointing.

    torchrun --nproc_per_node=8 17_binding_site_gradckpt.py --train data/biolip/train.jsonl \
        --valid data/biolip/valid.jsonl --ligand_types metal,nucleotide,small_molecule
"""
import argparse
import json
import logging
import os

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.metrics import average_precision_score
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from transformers import AutoTokenizer, EsmModel, get_linear_schedule_with_warmup

log = logging.getLogger("binding")


def get_args():
    p = argparse.ArgumentParser()
    p.add_argument("--train", required=True)
    p.add_argument("--valid", required=True)
    p.add_argument("--ligand_types", default="metal,nucleotide,small_molecule")
    p.add_argument("--model_name", default="facebook/esm2_t33_650M_UR50D")
    p.add_argument("--max_len", type=int, default=1024)
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-5)
    p.add_argument("--head_lr", type=float, default=1e-3)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--pos_weight", type=float, default=8.0)
    p.add_argument("--save_dir", default="runs/biolip_esm650")
    return p.parse_args()


class BindingDataset(Dataset):
    """jsonl records: {"id", "seq", "sites": {ligand_type: [0-based residue indices]}}"""

    def __init__(self, path, ligand_types, max_len):
        self.records = [json.loads(l) for l in open(path)]
        self.ligand_types, self.max_len = ligand_types, max_len

    def __len__(self):
        return len(self.records)

    def __getitem__(self, i):
        r = self.records[i]
        seq = r["seq"][:self.max_len - 2]
        y = torch.zeros(len(seq), len(self.ligand_types))
        for k, lt in enumerate(self.ligand_types):
            for pos in r["sites"].get(lt, []):
                if pos < len(seq):
                    y[pos, k] = 1.0
        return seq, y


class Collate:
    def __init__(self, tokenizer):
        self.tok = tokenizer

    def __call__(self, batch):
        seqs, ys = zip(*batch)
        enc = self.tok(list(seqs), padding=True, return_tensors="pt")
        T = enc["input_ids"].shape[1]
        labels = torch.full((len(seqs), T, ys[0].shape[1]), -1.0)
        for b, y in enumerate(ys):
            labels[b, 1:1 + y.shape[0]] = y          # position 0 is <cls>
        return enc["input_ids"], enc["attention_mask"], labels


class BindingSiteModel(nn.Module):
    def __init__(self, model_name, n_out):
        super().__init__()
        self.esm = EsmModel.from_pretrained(model_name)
        self.esm.gradient_checkpointing_enable()
        d = self.esm.config.hidden_size
        self.head = nn.Sequential(nn.Dropout(0.2), nn.Linear(d, 256), nn.GELU(), nn.Linear(256, n_out))

    def forward(self, input_ids, attention_mask):
        h = self.esm(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.head(h)


def masked_bce(logits, labels, pos_weight):
    m = labels >= 0
    w = torch.full_like(labels[m], pos_weight)
    return F.binary_cross_entropy_with_logits(logits[m], labels[m], pos_weight=w)


@torch.no_grad()
def evaluate(model, loader, device, world, n_types):
    model.eval()
    probs, targets = [], []
    for ids, mask, labels in loader:
        ids, mask = ids.to(device), mask.to(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            p = torch.sigmoid(model(ids, mask).float()).cpu()
        m = labels[..., 0] >= 0
        probs.append(p[m])
        targets.append(labels[m])
    local = (torch.cat(probs).numpy(), torch.cat(targets).numpy()) if probs else None
    gathered = [None] * world
    dist.all_gather_object(gathered, local)
    model.train()
    parts = [g for g in gathered if g is not None]
    P = torch.cat([torch.from_numpy(g[0]) for g in parts]).numpy()
    Y = torch.cat([torch.from_numpy(g[1]) for g in parts]).numpy()
    return [average_precision_score(Y[:, k], P[:, k]) for k in range(n_types)]


def main():
    args = get_args()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR, format="%(asctime)s %(message)s")
    torch.manual_seed(0)

    ligand_types = args.ligand_types.split(",")
    tokenizer = AutoTokenizer.from_pretrained(args.model_name)
    collate = Collate(tokenizer)
    train_set = BindingDataset(args.train, ligand_types, args.max_len)
    valid_set = BindingDataset(args.valid, ligand_types, args.max_len)
    train_sampler = DistributedSampler(train_set, shuffle=True, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=args.batch_size, sampler=train_sampler,
                              collate_fn=collate, num_workers=4, drop_last=True, pin_memory=True)
    valid_loader = DataLoader(torch.utils.data.Subset(valid_set, range(rank, len(valid_set), world)),
                              batch_size=8, collate_fn=collate, num_workers=2)

    model = BindingSiteModel(args.model_name, len(ligand_types)).to(device)
    # the pooler and the contact head of EsmModel take no part in this loss
    model = DDP(model, device_ids=[local_rank], find_unused_parameters=True)

    optimizer = torch.optim.AdamW([
        {"params": model.module.esm.parameters(), "lr": args.lr},
        {"params": model.module.head.parameters(), "lr": args.head_lr},
    ], weight_decay=0.01)
    total = args.epochs * len(train_loader)
    scheduler = get_linear_schedule_with_warmup(optimizer, int(0.1 * total), total)

    if rank == 0:
        os.makedirs(args.save_dir, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for step, (ids, mask, labels) in enumerate(train_loader):
            ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                logits = model(ids, mask)
            loss = masked_bce(logits.float(), labels, args.pos_weight)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            if step % 100 == 0:
                log.info("epoch %d step %d/%d loss %.4f", epoch, step, len(train_loader), loss.item())

        aps = evaluate(model.module, valid_loader, device, world, len(ligand_types))
        mean_ap = sum(aps) / len(aps)
        log.info("epoch %d valid AP %s mean %.4f", epoch,
                 " ".join(f"{lt}={ap:.3f}" for lt, ap in zip(ligand_types, aps)), mean_ap)
        if rank == 0 and mean_ap > best:
            best = mean_ap
            torch.save({"model": model.module.state_dict(), "ligand_types": ligand_types, "epoch": epoch},
                       os.path.join(args.save_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()

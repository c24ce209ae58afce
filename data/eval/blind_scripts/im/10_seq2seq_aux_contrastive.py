# Generative retrieval (semantic-ID decoding) + auxiliary in-batch contrastive loss between
# the pooled encoder state and the target item's content embedding. The contrastive term is
# switched on after a few epochs, once the decoder has learned the code structure.
#
# torchrun --standalone --nproc_per_node=4 10_seq2seq_aux_contrastive.py --data_dir data/beauty
import argparse
import json
import logging
import os

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, Subset
from torch.utils.data.distributed import DistributedSampler
from transformers import T5Config, T5ForConditionalGeneration

log = logging.getLogger(__name__)
PAD, EOS = 0, 1


class Examples(Dataset):
    def __init__(self, seqs, sem, K, split, max_items=20):
        self.sem, self.K = sem, K
        self.items = []
        for s in seqs:
            if split == "train":
                self.items.extend((s[max(0, t - max_items):t], s[t]) for t in range(1, len(s) - 2))
            elif split == "valid":
                self.items.append((s[-2 - max_items:-2], s[-2]))
            else:
                self.items.append((s[-1 - max_items:-1], s[-1]))

    def codes(self, it):
        return [2 + l * self.K + int(c) for l, c in enumerate(self.sem[it])]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        hist, tgt = self.items[i]
        return [t for it in hist for t in self.codes(it)], self.codes(tgt) + [EOS], tgt


def collate(batch):
    L = max(len(b[0]) for b in batch)
    src = torch.zeros(len(batch), L, dtype=torch.long)
    for i, b in enumerate(batch):
        src[i, :len(b[0])] = torch.tensor(b[0])
    labels = torch.tensor([b[1] for b in batch])
    tgt_item = torch.tensor([b[2] for b in batch])
    return src, labels, tgt_item


class GenRetriever(nn.Module):
    def __init__(self, t5_cfg, content_dim, proj_dim=128, tau=0.07):
        super().__init__()
        self.t5 = T5ForConditionalGeneration(t5_cfg)
        self.query_proj = nn.Sequential(nn.Linear(t5_cfg.d_model, proj_dim), nn.GELU(), nn.Linear(proj_dim, proj_dim))
        self.item_proj = nn.Linear(content_dim, proj_dim)
        self.tau = tau

    def forward(self, src, labels, tgt_content=None, use_aux=False):
        mask = (src != PAD).long()
        out = self.t5(input_ids=src, attention_mask=mask, labels=labels, output_hidden_states=False)
        loss = out.loss
        aux = torch.zeros((), device=src.device)
        if use_aux:
            enc = out.encoder_last_hidden_state
            pooled = (enc * mask.unsqueeze(-1)).sum(1) / mask.sum(1, keepdim=True).clamp(min=1)
            q = F.normalize(self.query_proj(pooled), dim=-1)
            k = F.normalize(self.item_proj(tgt_content), dim=-1)
            logits = q @ k.t() / self.tau
            aux = F.cross_entropy(logits, torch.arange(q.size(0), device=q.device))
        return loss, aux


@torch.no_grad()
def evaluate(t5, loader, device, n_levels, beams=10):
    t5.eval()
    s = torch.zeros(3, device=device)
    for src, labels, _ in loader:
        src, labels = src.to(device), labels.to(device)
        gen = t5.generate(input_ids=src, attention_mask=(src != PAD).long(), num_beams=beams,
                          num_return_sequences=beams, max_new_tokens=n_levels + 1)
        cand = gen[:, 1:n_levels + 1].view(src.size(0), beams, n_levels)
        m = (cand == labels[:, None, :n_levels]).all(-1)
        s[0] += m[:, :5].any(-1).sum()
        s[1] += m.any(-1).sum()
        s[2] += src.size(0)
    dist.all_reduce(s)
    t5.train()
    return (s[0] / s[2]).item(), (s[1] / s[2]).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data_dir", required=True)
    ap.add_argument("--K", type=int, default=256)
    ap.add_argument("--bs", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--aux_weight", type=float, default=0.1)
    ap.add_argument("--aux_start_epoch", type=int, default=5)
    ap.add_argument("--eval_every", type=int, default=5)
    ap.add_argument("--out", default="ckpt/aux_contrastive")
    args = ap.parse_args()

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", local_rank)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.ERROR, format="%(asctime)s %(message)s")
    torch.manual_seed(1)

    sem = np.load(os.path.join(args.data_dir, "sem_ids.npy"))
    content = torch.from_numpy(np.load(os.path.join(args.data_dir, "item_emb.npy"))).float()
    with open(os.path.join(args.data_dir, "seqs.json")) as f:
        seqs = json.load(f)
    n_levels = sem.shape[1]

    train = Examples(seqs, sem, args.K, "train")
    valid = Examples(seqs, sem, args.K, "valid")
    sampler = DistributedSampler(train, shuffle=True)
    train_dl = DataLoader(train, batch_size=args.bs, sampler=sampler, collate_fn=collate, num_workers=4,
                          pin_memory=True, drop_last=True)
    valid_dl = DataLoader(Subset(valid, range(rank, len(valid), world)), batch_size=128, collate_fn=collate)

    t5_cfg = T5Config(vocab_size=2 + n_levels * args.K, d_model=128, d_ff=1024, d_kv=64, num_layers=4,
                      num_heads=6, dropout_rate=0.1, pad_token_id=PAD, eos_token_id=EOS,
                      decoder_start_token_id=PAD)
    net = GenRetriever(t5_cfg, content.size(1)).to(device)
    model = DDP(net, device_ids=[local_rank])
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.035)
    content = content.to(device)

    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
    best = 0.0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        use_aux = epoch >= args.aux_start_epoch
        acc = torch.zeros(3, device=device)
        for src, labels, tgt_item in train_dl:
            src, labels = src.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            tgt_content = content[tgt_item.to(device)]
            gen_loss, aux_loss = model(src, labels, tgt_content, use_aux=use_aux)
            loss = gen_loss + args.aux_weight * aux_loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            acc += torch.stack([gen_loss.detach(), aux_loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(acc)
        log.info("epoch %d gen %.4f aux %.4f", epoch, (acc[0] / acc[2]).item(), (acc[1] / acc[2]).item())

        if (epoch + 1) % args.eval_every == 0:
            r5, r10 = evaluate(net.t5, valid_dl, device, n_levels)
            log.info("epoch %d valid recall@5 %.4f recall@10 %.4f", epoch, r5, r10)
            if rank == 0 and r10 > best:
                best = r10
                torch.save({"model": net.state_dict(), "epoch": epoch, "recall@10": r10},
                           os.path.join(args.out, "best.pt"))
            dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()

# LSTM language model over BPE units, used for shallow fusion in the ASR decoder.
# Text: LibriSpeech LM corpus + transcripts, already BPE-encoded to ids (one sentence per line).
#
#   python -m torch.distributed.run --nproc_per_node=4 16_rnnlm_shallow_fusion_tb.py \
#       --train data/lm/train.ids --valid data/lm/dev.ids --vocab 5000 --logdir exp/rnnlm/tb
import argparse
import math
import os
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

parser = argparse.ArgumentParser()
parser.add_argument("--train", required=True)
parser.add_argument("--valid", required=True)
parser.add_argument("--vocab", type=int, default=5000)
parser.add_argument("--logdir", default="exp/rnnlm/tb")
parser.add_argument("--ckpt-dir", default="exp/rnnlm")
parser.add_argument("--layers", type=int, default=4)
parser.add_argument("--units", type=int, default=2048)
parser.add_argument("--batch-size", type=int, default=128)
parser.add_argument("--bptt", type=int, default=256)
parser.add_argument("--epochs", type=int, default=20)
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--report-every", type=int, default=200)


class SentenceDataset(Dataset):
    """sentences of BPE ids; <sos/eos> = vocab"""

    def __init__(self, path, eos, max_len):
        self.sents = []
        with open(path) as f:
            for line in f:
                ids = [int(t) for t in line.split()][: max_len - 1]
                if ids:
                    self.sents.append(ids)
        self.eos = eos

    def __len__(self):
        return len(self.sents)

    def __getitem__(self, i):
        s = self.sents[i]
        return torch.tensor([self.eos] + s), torch.tensor(s + [self.eos])


def pad_batch(batch):
    x, y = zip(*batch)
    lens = torch.tensor([len(t) for t in x])
    return (nn.utils.rnn.pad_sequence(x, batch_first=True, padding_value=0),
            nn.utils.rnn.pad_sequence(y, batch_first=True, padding_value=-100), lens)


class RNNLM(nn.Module):
    def __init__(self, n_vocab, units, layers, dropout=0.2):
        super().__init__()
        self.embed = nn.Embedding(n_vocab, units)
        self.drop = nn.Dropout(dropout)
        self.lstm = nn.LSTM(units, units, layers, dropout=dropout, batch_first=True)
        self.proj = nn.Linear(units, n_vocab)
        self.proj.weight = self.embed.weight

    def forward(self, x, lens):
        h = self.drop(self.embed(x))
        packed = nn.utils.rnn.pack_padded_sequence(h, lens.cpu(), batch_first=True, enforce_sorted=False)
        out, _ = self.lstm(packed)
        out, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=x.size(1))
        return self.proj(self.drop(out))


def evaluate(model, loader, device):
    model.eval()
    tot = torch.zeros(2, device=device, dtype=torch.float64)
    with torch.no_grad():
        for x, y, lens in loader:
            x, y = x.to(device), y.to(device)
            logits = model(x, lens)
            tot[0] += F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=-100,
                                      reduction="sum").double()
            tot[1] += y.ne(-100).sum()
    dist.all_reduce(tot)
    model.train()
    return (tot[0] / tot[1]).item()


def main(args):
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda:%d" % local_rank)
    torch.manual_seed(0)

    n_vocab = args.vocab + 1
    train_ds = SentenceDataset(args.train, args.vocab, args.bptt)
    valid_ds = SentenceDataset(args.valid, args.vocab, args.bptt)
    sampler = DistributedSampler(train_ds, shuffle=True, drop_last=True)
    train_dl = DataLoader(train_ds, batch_size=args.batch_size, sampler=sampler, collate_fn=pad_batch,
                          num_workers=2, pin_memory=True, drop_last=True)
    valid_dl = DataLoader(torch.utils.data.Subset(valid_ds, range(rank, len(valid_ds), world)),
                          batch_size=256, collate_fn=pad_batch)

    model = RNNLM(n_vocab, args.units, args.layers).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="min", factor=0.5, patience=0)

    writer = SummaryWriter(log_dir=args.logdir)
    if rank == 0:
        os.makedirs(args.ckpt_dir, exist_ok=True)
        print(f"{len(train_ds)} train sentences, {len(train_dl)} batches per rank per epoch")

    best_ppl = float("inf")
    it = 0
    for epoch in range(args.epochs):
        sampler.set_epoch(epoch)
        model.train()
        t0, acc_loss, acc_n = time.time(), 0.0, 0
        for x, y, lens in train_dl:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            logits = model(x, lens)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.view(-1), ignore_index=-100)
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            it += 1
            acc_loss += loss.item()
            acc_n += 1
            if it % args.report_every == 0:
                writer.add_scalar("train/loss", acc_loss / acc_n, it)
                writer.add_scalar("train/ppl", math.exp(acc_loss / acc_n), it)
                writer.add_scalar("train/lr", optimizer.param_groups[0]["lr"], it)
                acc_loss, acc_n = 0.0, 0

        vloss = evaluate(model.module, valid_dl, device)
        scheduler.step(vloss)
        ppl = math.exp(vloss)
        writer.add_scalar("valid/ppl", ppl, epoch)
        if rank == 0:
            print(f"epoch {epoch} valid ppl {ppl:.2f} lr {optimizer.param_groups[0]['lr']:.2e} "
                  f"({time.time() - t0:.0f}s)", flush=True)
            torch.save(model.module.state_dict(), os.path.join(args.ckpt_dir, f"rnnlm.ep{epoch}.pth"))
            if ppl < best_ppl:
                best_ppl = ppl
                torch.save(model.module.state_dict(), os.path.join(args.ckpt_dir, "rnnlm.best.pth"))
        dist.barrier()

    writer.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(parser.parse_args())

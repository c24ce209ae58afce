"""
CTC speech recognizer (conv subsampling + BiLSTM) on LibriSpeech-100h.
Features (80-dim log-mel) are precomputed once and cached next to the manifest.

python -m torch.distributed.launch --use_env --nproc_per_node=4 15_asr_ctc.py \
    --train_manifest manifests/train-clean-100.tsv --dev_manifest manifests/dev-clean.tsv
"""
import os
import time
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.distributed as dist
import torchaudio
from torch.utils.data import Dataset, DataLoader
from torch.utils.data.distributed import DistributedSampler
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pad_sequence

VOCAB = ["<blank>", " ", "'"] + [chr(c) for c in range(ord('a'), ord('z') + 1)]
CHAR2ID = {c: i for i, c in enumerate(VOCAB)}

parser = argparse.ArgumentParser()
parser.add_argument('--train_manifest', default='manifests/train-clean-100.tsv')
parser.add_argument('--dev_manifest', default='manifests/dev-clean.tsv')
parser.add_argument('--hidden', type=int, default=512)
parser.add_argument('--layers', type=int, default=4)
parser.add_argument('--batch_size', type=int, default=16)
parser.add_argument('--lr', type=float, default=5e-4)
parser.add_argument('--epochs', type=int, default=40)
parser.add_argument('--max_frames', type=int, default=1600)
parser.add_argument('--exp', default='exp/ctc_blstm')
parser.add_argument('--spec_augment', action='store_true')
args = parser.parse_args()


def text_to_ids(t):
    return [CHAR2ID[c] for c in t.lower() if c in CHAR2ID]


def compute_fbank(path):
    wav, sr = torchaudio.load(path)
    if sr != 16000:
        wav = torchaudio.functional.resample(wav, sr, 16000)
    feat = torchaudio.compliance.kaldi.fbank(wav * 32768, num_mel_bins=80, sample_frequency=16000)
    return (feat - feat.mean(0)) / (feat.std(0) + 1e-5)


def load_or_build_features(manifest):
    cache = os.path.splitext(manifest)[0] + '.fbank80.pt'
    if os.path.exists(cache):
        return torch.load(cache)
    items = []
    with open(manifest) as f:
        root = f.readline().strip()
        for line in f:
            rel, n_samples, text = line.rstrip('\n').split('\t')
            items.append((compute_fbank(os.path.join(root, rel)).half(), torch.tensor(text_to_ids(text))))
    torch.save(items, cache)
    return items


class FbankDataset(Dataset):
    def __init__(self, manifest, max_frames=None, train=False):
        items = load_or_build_features(manifest)
        if max_frames is not None:
            items = [it for it in items if it[0].size(0) <= max_frames]
        self.items = items
        self.train = train

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        feat, tgt = self.items[i]
        feat = feat.float()
        if self.train and args.spec_augment:
            feat = torchaudio.transforms.FrequencyMasking(27)(feat.T.unsqueeze(0)).squeeze(0).T
            feat = torchaudio.transforms.TimeMasking(40)(feat.T.unsqueeze(0)).squeeze(0).T
        return feat, tgt


def collate(batch):
    feats, tgts = zip(*batch)
    flen = torch.tensor([f.size(0) for f in feats])
    tlen = torch.tensor([t.size(0) for t in tgts])
    return pad_sequence(feats, batch_first=True), flen, pad_sequence(tgts, batch_first=True), tlen


class CTCModel(nn.Module):
    def __init__(self, n_vocab, hidden, layers):
        super().__init__()
        self.sub = nn.Sequential(nn.Conv2d(1, 32, 3, 2, 1), nn.ReLU(), nn.Conv2d(32, 32, 3, 2, 1), nn.ReLU())
        self.proj = nn.Linear(32 * 20, hidden)
        self.rnn = nn.LSTM(hidden, hidden, layers, batch_first=True, bidirectional=True, dropout=0.2)
        self.out = nn.Linear(2 * hidden, n_vocab)

    def forward(self, x, lens):
        x = self.sub(x.unsqueeze(1))
        b, c, t, f = x.shape
        x = self.proj(x.permute(0, 2, 1, 3).reshape(b, t, c * f))
        lens = ((lens - 1) // 2) // 2 + 1
        x = nn.utils.rnn.pack_padded_sequence(x, lens.cpu(), batch_first=True, enforce_sorted=False)
        x, _ = self.rnn(x)
        x, _ = nn.utils.rnn.pad_packed_sequence(x, batch_first=True)
        return self.out(x).log_softmax(-1), lens


def edit_distance(a, b):
    d = list(range(len(b) + 1))
    for i in range(1, len(a) + 1):
        prev, d[0] = d[0], i
        for j in range(1, len(b) + 1):
            cur = d[j]
            d[j] = min(d[j] + 1, d[j - 1] + 1, prev + (a[i - 1] != b[j - 1]))
            prev = cur
    return d[len(b)]


def greedy_decode(logp, lens):
    out = []
    for seq, l in zip(logp.argmax(-1), lens):
        s, prev = [], -1
        for t in seq[:l].tolist():
            if t != prev and t != 0:
                s.append(VOCAB[t])
            prev = t
        out.append(''.join(s))
    return out


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    errs = torch.zeros(2, device=device)
    for x, xl, y, yl in loader:
        logp, ol = model(x.to(device), xl.to(device))
        hyps = greedy_decode(logp, ol)
        for h, ref, n in zip(hyps, y, yl):
            r = ''.join(VOCAB[i] for i in ref[:n].tolist()).split()
            errs[0] += edit_distance(h.split(), r)
            errs[1] += len(r)
    dist.all_reduce(errs)
    return (errs[0] / errs[1]).item()


def main():
    local_rank = int(os.environ['LOCAL_RANK'])
    torch.cuda.set_device(local_rank)
    dist.init_process_group('nccl')
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device('cuda', local_rank)

    train_ds = FbankDataset(args.train_manifest, args.max_frames, train=True)
    dev_ds = FbankDataset(args.dev_manifest)
    train_sampler = DistributedSampler(train_ds, shuffle=True)
    train_loader = DataLoader(train_ds, batch_size=args.batch_size, sampler=train_sampler, collate_fn=collate,
                              num_workers=4, pin_memory=True, drop_last=True)
    dev_idx = list(range(rank, len(dev_ds), world))
    dev_loader = DataLoader(torch.utils.data.Subset(dev_ds, dev_idx), batch_size=32, collate_fn=collate,
                            num_workers=2)

    model = CTCModel(len(VOCAB), args.hidden, args.layers).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=1e-2)
    sched = torch.optim.lr_scheduler.OneCycleLR(optimizer, args.lr, epochs=args.epochs,
                                                steps_per_epoch=len(train_loader), pct_start=0.1)
    ctc = nn.CTCLoss(blank=0, zero_infinity=True)
    if rank == 0:
        os.makedirs(args.exp, exist_ok=True)

    best_wer = 1e9
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        t0, tot = time.time(), torch.zeros(2, device=device)
        for x, xl, y, yl in train_loader:
            x, xl, y, yl = x.to(device), xl.to(device), y.to(device), yl.to(device)
            logp, ol = model(x, xl)
            loss = ctc(logp.transpose(0, 1), y, ol, yl)
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(model.parameters(), 5.0)
            optimizer.step()
            sched.step()
            tot += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(tot)
        wer = evaluate(model.module, dev_loader, device)
        if rank == 0:
            print('epoch %d loss %.3f dev WER %.2f%% (%.0fs)' % (epoch, tot[0] / tot[1], 100 * wer,
                                                                time.time() - t0), flush=True)
            torch.save(model.module.state_dict(), os.path.join(args.exp, 'last.pt'))
            if wer < best_wer:
                best_wer = wer
                torch.save(model.module.state_dict(), os.path.join(args.exp, 'best.pt'))
    dist.destroy_process_group()


if __name__ == '__main__':
    main()

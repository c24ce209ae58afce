"""Spiking Speech Commands (SSC) with a recurrent SNN trained by truncated BPTT.

The 1 ms-binned inputs (~1000 steps) are cut into chunks; the hidden membrane
and spike state live in the layers and are carried from one chunk to the next
(detached between chunks), and cleared before each new batch.

Runs on all visible GPUs of one machine:
    CUDA_VISIBLE_DEVICES=0,1,2,3 python 19_ssc_tbptt_dataparallel.py --data /data/tonic --chunk 100
"""
import argparse
import json
import os
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import tonic
import tonic.transforms as tt
from tonic.collation import PadTensors
from torch.utils.data import DataLoader


class SpikeFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return (x > 0).float()

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return g / (1.0 + 5.0 * x.abs()) ** 2


class RecurrentLIF(nn.Module):
    def __init__(self, n_in, n_hidden, tau_init=20.0):
        super().__init__()
        self.ff = nn.Linear(n_in, n_hidden)
        self.rec = nn.Linear(n_hidden, n_hidden, bias=False)
        nn.init.orthogonal_(self.rec.weight, gain=0.5)
        self.log_tau = nn.Parameter(torch.full((n_hidden,), float(torch.log(torch.tensor(tau_init)))))
        self.v = None
        self.s = None

    def reset_state(self):
        self.v, self.s = None, None

    def detach_state(self):
        if self.v is not None:
            self.v, self.s = self.v.detach(), self.s.detach()

    def forward(self, x_seq):  # [T, B, n_in] -> [T, B, n_hidden]
        if self.v is None:
            B = x_seq.size(1)
            self.v = x_seq.new_zeros(B, self.rec.in_features)
            self.s = x_seq.new_zeros(B, self.rec.in_features)
        alpha = torch.exp(-1.0 / self.log_tau.exp())
        ff = self.ff(x_seq)
        out = []
        for t in range(x_seq.size(0)):
            self.v = alpha * self.v + (1 - alpha) * (ff[t] + self.rec(self.s)) - self.s  # subtractive reset
            self.s = SpikeFn.apply(self.v - 1.0)
            out.append(self.s)
        return torch.stack(out)


class LeakyReadout(nn.Module):
    def __init__(self, n_in, n_out, tau=20.0):
        super().__init__()
        self.fc = nn.Linear(n_in, n_out)
        self.alpha = float(torch.exp(torch.tensor(-1.0 / tau)))
        self.v = None

    def reset_state(self):
        self.v = None

    def detach_state(self):
        if self.v is not None:
            self.v = self.v.detach()

    def forward(self, x_seq):
        cur = self.fc(x_seq)
        if self.v is None:
            self.v = torch.zeros_like(cur[0])
        out = []
        for t in range(cur.size(0)):
            self.v = self.alpha * self.v + (1 - self.alpha) * cur[t]
            out.append(self.v)
        return torch.stack(out)


class SSCNet(nn.Module):
    def __init__(self, n_in=140, hidden=512, n_classes=35):
        super().__init__()
        self.l1 = RecurrentLIF(n_in, hidden)
        self.l2 = RecurrentLIF(hidden, hidden)
        self.drop = nn.Dropout(0.15)
        self.readout = LeakyReadout(hidden, n_classes)

    def stateful(self):
        return [m for m in self.modules() if hasattr(m, "reset_state") and m is not self]

    def reset_state(self):
        for m in self.stateful():
            m.reset_state()

    def detach_state(self):
        for m in self.stateful():
            m.detach_state()

    def forward(self, x_chunk):
        # batch-first chunk [B, T, C] so DataParallel splits along the batch
        x = x_chunk.transpose(0, 1)
        h = self.drop(self.l1(x))
        h = self.drop(self.l2(h))
        return self.readout(h).mean(0)  # [B, n_classes], mean readout over the chunk


def get_loaders(root, batch_size, workers):
    tf = tt.Compose([tt.Downsample(spatial_factor=0.2), tt.ToFrame(sensor_size=(140, 1, 1), time_window=1000)])
    train = tonic.datasets.SSC(save_to=root, split="train", transform=tf)
    val = tonic.datasets.SSC(save_to=root, split="valid", transform=tf)
    test = tonic.datasets.SSC(save_to=root, split="test", transform=tf)
    collate = PadTensors(batch_first=True)
    mk = lambda ds, shuffle: DataLoader(ds, batch_size=batch_size, shuffle=shuffle, drop_last=shuffle,
                                        num_workers=workers, pin_memory=True, collate_fn=collate)
    return mk(train, True), mk(val, False), mk(test, False)


def run_batch(model, net, x, y, chunk, optimizer=None):
    """x [B, T, 1, 140]; returns (sum loss, #correct)."""
    net.reset_state()
    x = x.flatten(2)
    n_chunks = (x.size(1) + chunk - 1) // chunk
    logits_sum, loss_sum = 0.0, 0.0
    for k in range(n_chunks):
        logits = model(x[:, k * chunk:(k + 1) * chunk])
        w = (k + 1) / n_chunks  # later chunks have seen more of the utterance
        loss = w * F.cross_entropy(logits, y)
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            optimizer.step()
            net.detach_state()
        logits_sum = logits_sum + w * logits.detach()
        loss_sum += loss.item()
    return loss_sum, (logits_sum.argmax(1) == y).sum().item()


def evaluate(model, net, loader, device, chunk):
    model.eval()
    correct = n = 0
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            _, c = run_batch(model, net, x, y, chunk)
            correct += c
            n += y.numel()
    return correct / n


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="/data/tonic")
    ap.add_argument("--out", default="runs/ssc_tbptt")
    ap.add_argument("--chunk", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=60)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--workers", type=int, default=12)
    args = ap.parse_args()

    device = torch.device("cuda")
    os.makedirs(args.out, exist_ok=True)
    train_loader, val_loader, test_loader = get_loaders(args.data, args.batch_size, args.workers)

    net = SSCNet().to(device)
    model = nn.DataParallel(net)
    print(f"training on {torch.cuda.device_count()} GPUs", flush=True)
    optimizer = torch.optim.Adam(net.parameters(), lr=args.lr)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode="max", factor=0.5, patience=4)

    best, log = 0.0, []
    for epoch in range(args.epochs):
        model.train()
        tic, tot_loss, tot_correct, tot_n = time.time(), 0.0, 0, 0
        for x, y in train_loader:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            l, c = run_batch(model, net, x, y, args.chunk, optimizer)
            tot_loss += l * y.numel()
            tot_correct += c
            tot_n += y.numel()
        val_acc = evaluate(model, net, val_loader, device, args.chunk)
        scheduler.step(val_acc)
        log.append({"epoch": epoch, "loss": tot_loss / tot_n, "train_acc": tot_correct / tot_n, "val_acc": val_acc})
        print(f"epoch {epoch}: loss {tot_loss / tot_n:.4f} train {tot_correct / tot_n:.4f} val {val_acc:.4f} "
              f"({time.time() - tic:.0f}s)", flush=True)
        if val_acc > best:
            best = val_acc
            torch.save(net.state_dict(), os.path.join(args.out, "best.pt"))
        with open(os.path.join(args.out, "log.json"), "w") as f:
            json.dump(log, f, indent=1)

    net.load_state_dict(torch.load(os.path.join(args.out, "best.pt"), map_location=device))
    print(f"test acc {evaluate(model, net, test_loader, device, args.chunk):.4f} (best val {best:.4f})")


if __name__ == "__main__":
    main()

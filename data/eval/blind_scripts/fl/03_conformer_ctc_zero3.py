"""Conformer-CTC on LibriSpeech with DeepSpeed ZeRO-3 (param + optimizer offload).

    deepspeed --num_gpus 4 03_conformer_ctc_zero3.py \
        --librispeech-root /data/LibriSpeech --out exp/conformer_l
"""
import argparse
import math
import os
import time

import deepspeed
import editdistance
import torch
import torch.distributed as dist
import torch.nn as nn
import torchaudio
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

VOCAB = ["<blank>", " ", "'"] + [chr(c) for c in range(ord("A"), ord("Z") + 1)]
CHAR2ID = {c: i for i, c in enumerate(VOCAB)}


def text_to_ids(text):
    return torch.tensor([CHAR2ID[c] for c in text.upper() if c in CHAR2ID], dtype=torch.long)


def ids_to_text(ids):
    out, prev = [], None
    for i in ids:
        if i != prev and i != 0:
            out.append(VOCAB[i])
        prev = i
    return "".join(out)


class Collate:
    def __init__(self, n_mels=80, train=True):
        self.fbank = torchaudio.transforms.MelSpectrogram(sample_rate=16000, n_fft=400,
                                                          hop_length=160, n_mels=n_mels)
        self.specaug = nn.Sequential(
            torchaudio.transforms.FrequencyMasking(27),
            torchaudio.transforms.TimeMasking(40),
        ) if train else None

    def __call__(self, batch):
        feats, feat_lens, targets, target_lens, texts = [], [], [], [], []
        for wav, _sr, text, *_ in batch:
            x = (self.fbank(wav[0]) + 1e-6).log().transpose(0, 1)  # T x F
            x = (x - x.mean(0)) / (x.std(0) + 1e-5)
            if self.specaug is not None:
                x = self.specaug(x.transpose(0, 1)).transpose(0, 1)
            y = text_to_ids(text)
            feats.append(x)
            feat_lens.append(x.size(0))
            targets.append(y)
            target_lens.append(y.numel())
            texts.append(text)
        return (pad_sequence(feats, batch_first=True), torch.tensor(feat_lens),
                pad_sequence(targets, batch_first=True), torch.tensor(target_lens), texts)


class ConformerCTC(nn.Module):
    def __init__(self, n_mels=80, d_model=512, n_layers=17, n_heads=8, ffn_dim=2048, vocab=len(VOCAB)):
        super().__init__()
        self.subsample = nn.Sequential(
            nn.Conv2d(1, d_model, 3, stride=2), nn.ReLU(),
            nn.Conv2d(d_model, d_model, 3, stride=2), nn.ReLU(),
        )
        self.proj = nn.Linear(d_model * (((n_mels - 1) // 2 - 1) // 2), d_model)
        self.encoder = torchaudio.models.Conformer(
            input_dim=d_model, num_heads=n_heads, ffn_dim=ffn_dim,
            num_layers=n_layers, depthwise_conv_kernel_size=31, dropout=0.1,
        )
        self.head = nn.Linear(d_model, vocab)

    def forward(self, feats, lengths):
        x = self.subsample(feats.unsqueeze(1))  # B x C x T' x F'
        b, c, t, f = x.shape
        x = self.proj(x.permute(0, 2, 1, 3).reshape(b, t, c * f))
        lengths = ((lengths - 1) // 2 - 1) // 2
        x, lengths = self.encoder(x, lengths)
        return self.head(x), lengths


def get_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--librispeech-root", required=True)
    parser.add_argument("--train-splits", nargs="+", default=["train-clean-100", "train-clean-360"])
    parser.add_argument("--dev-split", default="dev-clean")
    parser.add_argument("--out", default="exp/conformer")
    parser.add_argument("--epochs", type=int, default=50)
    parser.add_argument("--micro-bsz", type=int, default=16)
    parser.add_argument("--accum", type=int, default=4)
    parser.add_argument("--peak-lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=10000)
    parser.add_argument("--local_rank", type=int, default=-1)
    return parser.parse_args()


def make_ds_config(args, total_steps):
    return {
        "train_micro_batch_size_per_gpu": args.micro_bsz,
        "gradient_accumulation_steps": args.accum,
        "gradient_clipping": 5.0,
        "optimizer": {"type": "AdamW",
                      "params": {"lr": args.peak_lr, "betas": [0.9, 0.98], "eps": 1e-9,
                                 "weight_decay": 1e-3}},
        "scheduler": {"type": "WarmupDecayLR",
                      "params": {"warmup_min_lr": 0, "warmup_max_lr": args.peak_lr,
                                 "warmup_num_steps": args.warmup,
                                 "total_num_steps": total_steps}},
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12,
                 "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1},
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {"device": "cpu", "pin_memory": True},
            "offload_param": {"device": "cpu", "pin_memory": True},
            "overlap_comm": True,
            "contiguous_gradients": True,
            "stage3_max_live_parameters": 1e9,
            "stage3_prefetch_bucket_size": 5e7,
            "stage3_param_persistence_threshold": 1e5,
        },
        "steps_per_print": 100,
    }


@torch.no_grad()
def evaluate(engine, loader):
    engine.eval()
    errs = torch.zeros(2, device=engine.device)
    for feats, feat_lens, _, _, texts in loader:
        logits, out_lens = engine(feats.to(engine.device).half(), feat_lens.to(engine.device))
        hyp_ids = logits.argmax(-1).cpu()
        for i, ref in enumerate(texts):
            hyp = ids_to_text(hyp_ids[i, : out_lens[i]].tolist())
            ref_words = ref.upper().split()
            errs[0] += editdistance.eval(hyp.split(), ref_words)
            errs[1] += len(ref_words)
    dist.all_reduce(errs)
    engine.train()
    return (errs[0] / errs[1]).item()


def main():
    args = get_args()
    deepspeed.init_distributed()
    rank, world = dist.get_rank(), dist.get_world_size()

    train_set = torch.utils.data.ConcatDataset([
        torchaudio.datasets.LIBRISPEECH(args.librispeech_root, url=s, download=False)
        for s in args.train_splits
    ])
    dev_set = torchaudio.datasets.LIBRISPEECH(args.librispeech_root, url=args.dev_split, download=False)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=1234)
    train_loader = DataLoader(train_set, batch_size=args.micro_bsz, sampler=train_sampler,
                              collate_fn=Collate(train=True), num_workers=6, drop_last=True)
    dev_loader = DataLoader(dev_set, batch_size=32, sampler=DistributedSampler(dev_set, shuffle=False),
                            collate_fn=Collate(train=False), num_workers=4)

    steps_per_epoch = len(train_loader) // args.accum
    model = ConformerCTC()
    engine, _, _, _ = deepspeed.initialize(
        model=model,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
        config=make_ds_config(args, steps_per_epoch * args.epochs),
    )
    ctc = nn.CTCLoss(blank=0, zero_infinity=True)
    os.makedirs(args.out, exist_ok=True)

    best_wer = math.inf
    for epoch in range(args.epochs):
        train_sampler.set_epoch(epoch)
        t0 = time.time()
        for step, (feats, feat_lens, targets, target_lens, _) in enumerate(train_loader):
            feats = feats.to(engine.device, non_blocking=True).half()
            feat_lens = feat_lens.to(engine.device)
            logits, out_lens = engine(feats, feat_lens)
            log_probs = logits.float().log_softmax(-1).transpose(0, 1)  # T x B x V
            loss = ctc(log_probs, targets.to(engine.device), out_lens, target_lens.to(engine.device))
            engine.backward(loss)
            engine.step()
            if rank == 0 and step % 200 == 0:
                print(f"epoch {epoch} step {step}/{len(train_loader)} ctc {loss.item():.3f} "
                      f"{(time.time() - t0) / (step + 1):.2f}s/it", flush=True)

        wer = evaluate(engine, dev_loader)
        if rank == 0:
            print(f"== epoch {epoch} dev WER {wer * 100:.2f}%", flush=True)

        engine.save_checkpoint(args.out, tag=f"epoch_{epoch}", client_state={"epoch": epoch, "wer": wer})

        if wer < best_wer:
            best_wer = wer
            if rank == 0:
                weights = {k: v.detach().float().cpu() for k, v in engine.module.state_dict().items()}
                torch.save({"model": weights, "vocab": VOCAB, "dev_wer": wer},
                           os.path.join(args.out, "best_model.pt"))
                print(f"exported best model (WER {wer * 100:.2f}%)", flush=True)

    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

"""Conformer-CTC ASR on LibriSpeech (character vocabulary).

    torchrun --nproc_per_node=8 14_speech_ctc.py model=conformer_m train.resume=outputs/2024-03-02/10-41-07/ckpt/last.pt
"""
import logging
import os
import string

import editdistance
import hydra
import torch
import torch.distributed as dist
import torch.nn as nn
import torchaudio
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate, to_absolute_path
from omegaconf import DictConfig, OmegaConf
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.nn.utils.rnn import pad_sequence
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

log = logging.getLogger(__name__)

VOCAB = ["<blank>", " ", "'"] + list(string.ascii_lowercase)
CHAR2ID = {c: i for i, c in enumerate(VOCAB)}


class LibriFeatures(torch.utils.data.Dataset):
    def __init__(self, root, url, n_mels=80, specaug=False):
        self.ds = torchaudio.datasets.LIBRISPEECH(root, url=url, download=False)
        self.fbank = torchaudio.transforms.MelSpectrogram(16000, n_fft=400, hop_length=160, n_mels=n_mels)
        self.specaug = nn.Sequential(
            torchaudio.transforms.FrequencyMasking(27),
            torchaudio.transforms.TimeMasking(100, p=0.05),
        ) if specaug else None

    def __len__(self):
        return len(self.ds)

    def __getitem__(self, i):
        wav, sr, text, *_ = self.ds[i]
        feats = (self.fbank(wav) + 1e-6).log().squeeze(0)
        feats = (feats - feats.mean(1, keepdim=True)) / (feats.std(1, keepdim=True) + 1e-5)
        if self.specaug is not None:
            feats = self.specaug(feats)
        tokens = torch.tensor([CHAR2ID[c] for c in text.lower() if c in CHAR2ID])
        return feats.t(), tokens


def collate(batch):
    feats, tokens = zip(*batch)
    feat_lens = torch.tensor([f.size(0) for f in feats])
    tok_lens = torch.tensor([t.size(0) for t in tokens])
    return pad_sequence(feats, batch_first=True), feat_lens, pad_sequence(tokens, batch_first=True), tok_lens


def greedy_decode(log_probs, lens):
    out = []
    for lp, n in zip(log_probs.argmax(-1), lens):
        prev, s = -1, []
        for t in lp[:n].tolist():
            if t != prev and t != 0:
                s.append(VOCAB[t])
            prev = t
        out.append("".join(s))
    return out


@torch.no_grad()
def evaluate(model, loader, device):
    model.eval()
    errs = torch.zeros(2, device=device)
    for feats, feat_lens, tokens, tok_lens in loader:
        feats, feat_lens = feats.to(device), feat_lens.to(device)
        log_probs, out_lens = model(feats, feat_lens)
        hyps = greedy_decode(log_probs.cpu(), out_lens.cpu())
        for h, t, n in zip(hyps, tokens, tok_lens):
            ref = "".join(VOCAB[i] for i in t[:n].tolist())
            errs[0] += editdistance.eval(h.split(), ref.split())
            errs[1] += len(ref.split())
    dist.all_reduce(errs)
    model.train()
    return (errs[0] / errs[1]).item()


@hydra.main(version_base="1.3", config_path="conf", config_name="asr")
def main(cfg: DictConfig):
    dist.init_process_group(backend="nccl")
    rank = dist.get_rank()
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    torch.manual_seed(cfg.seed)
    out_dir = HydraConfig.get().runtime.output_dir
    ckpt_dir = os.path.join(out_dir, "ckpt")
    if rank == 0:
        os.makedirs(ckpt_dir, exist_ok=True)

    root = to_absolute_path(cfg.data.root)
    train_set = torch.utils.data.ConcatDataset(
        [LibriFeatures(root, url, cfg.data.n_mels, specaug=True) for url in cfg.data.train_urls])
    dev_set = LibriFeatures(root, cfg.data.dev_url, cfg.data.n_mels)
    train_sampler = DistributedSampler(train_set, shuffle=True, seed=cfg.seed, drop_last=True)
    train_loader = DataLoader(train_set, batch_size=cfg.train.batch_size, sampler=train_sampler,
                              collate_fn=collate, num_workers=cfg.data.workers, pin_memory=True, drop_last=True)
    dev_loader = DataLoader(dev_set, batch_size=cfg.train.batch_size,
                            sampler=DistributedSampler(dev_set, shuffle=False), collate_fn=collate,
                            num_workers=cfg.data.workers)

    model = instantiate(cfg.model, input_dim=cfg.data.n_mels, vocab_size=len(VOCAB)).to(device)
    model = DDP(model, device_ids=[local_rank])
    optimizer = instantiate(cfg.optim, params=model.parameters())
    # Noam schedule
    d_model, warmup = cfg.model.encoder_dim, cfg.train.warmup
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: cfg.train.peak_scale * d_model ** -0.5 * min((s + 1) ** -0.5, (s + 1) * warmup ** -1.5))
    scaler = torch.cuda.amp.GradScaler()
    ctc = nn.CTCLoss(blank=0, zero_infinity=True)

    start_epoch, step, best_wer = 0, 0, float("inf")
    if cfg.train.resume:
        ckpt = torch.load(to_absolute_path(cfg.train.resume))
        model.module.load_state_dict(ckpt["model"])
        optimizer.load_state_dict(ckpt["optimizer"])
        scheduler.load_state_dict(ckpt["scheduler"])
        scaler.load_state_dict(ckpt["scaler"])
        start_epoch, step, best_wer = ckpt["epoch"] + 1, ckpt["step"], ckpt["best_wer"]
        if rank == 0:
            log.info("resumed from %s (epoch %d, step %d)", cfg.train.resume, start_epoch, step)

    for epoch in range(start_epoch, cfg.train.epochs):
        train_sampler.set_epoch(epoch)
        model.train()
        for feats, feat_lens, tokens, tok_lens in train_loader:
            feats, feat_lens = feats.to(device, non_blocking=True), feat_lens.to(device)
            tokens, tok_lens = tokens.to(device), tok_lens.to(device)
            with torch.autocast("cuda", dtype=torch.float16):
                log_probs, out_lens = model(feats, feat_lens)
            loss = ctc(log_probs.float().transpose(0, 1), tokens, out_lens, tok_lens)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            nn.utils.clip_grad_norm_(model.parameters(), cfg.train.clip)
            scaler.step(optimizer)
            scaler.update()
            scheduler.step()
            step += 1
            if rank == 0 and step % cfg.train.log_every == 0:
                log.info("epoch %d step %d ctc %.3f lr %.2e", epoch, step, loss.item(), scheduler.get_last_lr()[0])

        wer = evaluate(model, dev_loader, device)
        best_wer = min(best_wer, wer)
        if rank == 0:
            log.info("epoch %d dev WER %.4f (best %.4f)", epoch, wer, best_wer)
            state = {"model": model.module.state_dict(), "optimizer": optimizer.state_dict(),
                     "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                     "epoch": epoch, "step": step, "best_wer": best_wer,
                     "cfg": OmegaConf.to_container(cfg, resolve=True)}
            torch.save(state, os.path.join(ckpt_dir, "last.pt"))
            if wer <= best_wer:
                torch.save(state, os.path.join(ckpt_dir, "best.pt"))
        dist.barrier()

    dist.destroy_process_group()


if __name__ == "__main__":
    main()

import argparse
import os
import random
import time

import matplotlib
matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler
from torch.utils.tensorboard import SummaryWriter

from layers import TacotronSTFT
from text import text_to_sequence, symbols
from utils import load_wav_to_torch, load_filepaths_and_text


class TextMelLoader(Dataset):
    def __init__(self, filelist, hp):
        self.items = load_filepaths_and_text(filelist)
        self.stft = TacotronSTFT(hp.filter_length, hp.hop_length, hp.win_length,
                                 hp.n_mel_channels, hp.sampling_rate, hp.mel_fmin, hp.mel_fmax)
        self.load_mel_from_disk = hp.load_mel_from_disk
        random.seed(hp.seed)
        random.shuffle(self.items)

    def get_mel(self, path):
        if self.load_mel_from_disk:
            return torch.from_numpy(np.load(path))
        audio, sr = load_wav_to_torch(path)
        audio = (audio / 32768.0).unsqueeze(0)
        return self.stft.mel_spectrogram(audio).squeeze(0)

    def __getitem__(self, i):
        path, text = self.items[i][0], self.items[i][1]
        return torch.IntTensor(text_to_sequence(text, ["english_cleaners"])), self.get_mel(path)

    def __len__(self):
        return len(self.items)


class TextMelCollate:
    def __init__(self, n_frames_per_step=1):
        self.r = n_frames_per_step

    def __call__(self, batch):
        lens, ids = torch.sort(torch.LongTensor([len(x[0]) for x in batch]), descending=True)
        text = torch.zeros(len(batch), lens[0], dtype=torch.long)
        for i, j in enumerate(ids):
            text[i, :batch[j][0].size(0)] = batch[j][0]
        n_mel = batch[0][1].size(0)
        max_t = max(x[1].size(1) for x in batch)
        max_t += (self.r - max_t % self.r) % self.r
        mel = torch.zeros(len(batch), n_mel, max_t)
        gate = torch.zeros(len(batch), max_t)
        out_lens = torch.LongTensor(len(batch))
        for i, j in enumerate(ids):
            m = batch[j][1]
            mel[i, :, :m.size(1)] = m
            gate[i, m.size(1) - 1:] = 1
            out_lens[i] = m.size(1)
        return text, lens, mel, gate, out_lens


class Prenet(nn.Module):
    def __init__(self, in_dim, sizes=(256, 256)):
        super().__init__()
        dims = [in_dim] + list(sizes)
        self.layers = nn.ModuleList([nn.Linear(a, b, bias=False) for a, b in zip(dims[:-1], dims[1:])])

    def forward(self, x):
        for l in self.layers:
            x = F.dropout(F.relu(l(x)), p=0.5, training=True)
        return x


class LocationAttention(nn.Module):
    def __init__(self, rnn_dim=1024, emb_dim=512, att_dim=128, n_filters=32, k=31):
        super().__init__()
        self.query = nn.Linear(rnn_dim, att_dim, bias=False)
        self.memory = nn.Linear(emb_dim, att_dim, bias=False)
        self.v = nn.Linear(att_dim, 1, bias=False)
        self.loc_conv = nn.Conv1d(2, n_filters, k, padding=k // 2, bias=False)
        self.loc_dense = nn.Linear(n_filters, att_dim, bias=False)

    def forward(self, q, memory, processed_memory, att_cat, mask):
        loc = self.loc_dense(self.loc_conv(att_cat).transpose(1, 2))
        energies = self.v(torch.tanh(self.query(q).unsqueeze(1) + loc + processed_memory)).squeeze(-1)
        energies = energies.masked_fill(mask, -float("inf"))
        w = F.softmax(energies, dim=1)
        return torch.bmm(w.unsqueeze(1), memory).squeeze(1), w


class Tacotron2(nn.Module):
    def __init__(self, hp):
        super().__init__()
        self.n_mel = hp.n_mel_channels
        self.max_decoder_steps = hp.max_decoder_steps
        self.embedding = nn.Embedding(len(symbols), 512)
        self.convs = nn.ModuleList([nn.Sequential(nn.Conv1d(512, 512, 5, padding=2), nn.BatchNorm1d(512))
                                    for _ in range(3)])
        self.lstm = nn.LSTM(512, 256, batch_first=True, bidirectional=True)
        self.prenet = Prenet(self.n_mel)
        self.attention_rnn = nn.LSTMCell(256 + 512, 1024)
        self.attention = LocationAttention()
        self.decoder_rnn = nn.LSTMCell(1024 + 512, 1024)
        self.mel_proj = nn.Linear(1024 + 512, self.n_mel)
        self.gate_proj = nn.Linear(1024 + 512, 1)
        post = []
        for i in range(5):
            cin = self.n_mel if i == 0 else 512
            cout = self.n_mel if i == 4 else 512
            post.append(nn.Sequential(nn.Conv1d(cin, cout, 5, padding=2), nn.BatchNorm1d(cout)))
        self.postnet = nn.ModuleList(post)

    def encode(self, text, lens):
        x = self.embedding(text).transpose(1, 2)
        for c in self.convs:
            x = F.dropout(F.relu(c(x)), 0.5, self.training)
        x = nn.utils.rnn.pack_padded_sequence(x.transpose(1, 2), lens.cpu(), batch_first=True)
        self.lstm.flatten_parameters()
        out, _ = self.lstm(x)
        return nn.utils.rnn.pad_packed_sequence(out, batch_first=True)[0]

    def _init_state(self, memory):
        B, T, _ = memory.shape
        z = memory.new_zeros
        return dict(ah=z(B, 1024), ac=z(B, 1024), dh=z(B, 1024), dc=z(B, 1024),
                    w=z(B, T), w_cum=z(B, T), ctx=z(B, 512))

    def _step(self, prev, memory, pmem, mask, s):
        s["ah"], s["ac"] = self.attention_rnn(torch.cat([prev, s["ctx"]], -1), (s["ah"], s["ac"]))
        s["ah"] = F.dropout(s["ah"], 0.1, self.training)
        att_cat = torch.stack([s["w"], s["w_cum"]], 1)
        s["ctx"], s["w"] = self.attention(s["ah"], memory, pmem, att_cat, mask)
        s["w_cum"] = s["w_cum"] + s["w"]
        s["dh"], s["dc"] = self.decoder_rnn(torch.cat([s["ah"], s["ctx"]], -1), (s["dh"], s["dc"]))
        s["dh"] = F.dropout(s["dh"], 0.1, self.training)
        hc = torch.cat([s["dh"], s["ctx"]], -1)
        return self.mel_proj(hc), self.gate_proj(hc).squeeze(1), s["w"]

    def _postnet(self, mel):
        x = mel
        for i, p in enumerate(self.postnet):
            x = p(x)
            if i < len(self.postnet) - 1:
                x = torch.tanh(x)
            x = F.dropout(x, 0.5, self.training)
        return mel + x

    def forward(self, text, text_lens, mel):
        memory = self.encode(text, text_lens)
        pmem = self.attention.memory(memory)
        mask = torch.arange(memory.size(1), device=text.device)[None] >= text_lens[:, None]
        s = self._init_state(memory)
        prev = self.prenet(torch.cat([memory.new_zeros(1, mel.size(0), self.n_mel), mel.permute(2, 0, 1)[:-1]], 0))
        mels, gates, aligns = [], [], []
        for t in range(mel.size(2)):
            m, g, a = self._step(prev[t], memory, pmem, mask, s)
            mels.append(m); gates.append(g); aligns.append(a)
        mel_out = torch.stack(mels, 2)
        return mel_out, self._postnet(mel_out), torch.stack(gates, 1), torch.stack(aligns, 1)

    @torch.no_grad()
    def inference(self, text):
        lens = torch.LongTensor([text.size(1)]).to(text.device)
        memory = self.encode(text, lens)
        pmem = self.attention.memory(memory)
        mask = torch.zeros(1, memory.size(1), dtype=torch.bool, device=text.device)
        s = self._init_state(memory)
        frame = memory.new_zeros(1, self.n_mel)
        mels, aligns = [], []
        for _ in range(self.max_decoder_steps):
            m, g, a = self._step(self.prenet(frame), memory, pmem, mask, s)
            mels.append(m); aligns.append(a)
            if torch.sigmoid(g).item() > 0.5:
                break
            frame = m
        mel_out = torch.stack(mels, 2)
        return self._postnet(mel_out), torch.stack(aligns, 1)


def tacotron2_loss(mel_out, mel_post, gate_out, mel_t, gate_t):
    return F.mse_loss(mel_out, mel_t) + F.mse_loss(mel_post, mel_t) + F.binary_cross_entropy_with_logits(gate_out, gate_t)


def plot_to_numpy(data, xlabel, ylabel):
    fig, ax = plt.subplots(figsize=(10, 4))
    im = ax.imshow(data, aspect="auto", origin="lower", interpolation="none")
    fig.colorbar(im, ax=ax)
    ax.set_xlabel(xlabel); ax.set_ylabel(ylabel)
    fig.canvas.draw()
    img = np.asarray(fig.canvas.buffer_rgba())[..., :3].copy()
    plt.close(fig)
    return img


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("-o", "--output_directory", required=True)
    ap.add_argument("-c", "--checkpoint_path", default=None)
    ap.add_argument("--hparams", default="hparams.yaml")
    ap.add_argument("--sample_text", default="The quick brown fox jumps over the lazy dog.")
    args = ap.parse_args()

    from omegaconf import OmegaConf
    hp = OmegaConf.load(args.hparams)

    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    dist.init_process_group(backend="nccl", init_method="env://")
    rank = dist.get_rank()
    torch.manual_seed(hp.seed)
    torch.cuda.manual_seed(hp.seed)

    trainset = TextMelLoader(hp.training_files, hp)
    valset = TextMelLoader(hp.validation_files, hp)
    collate = TextMelCollate(hp.n_frames_per_step)
    train_sampler = DistributedSampler(trainset)
    train_loader = DataLoader(trainset, num_workers=1, sampler=train_sampler, batch_size=hp.batch_size,
                              pin_memory=False, drop_last=True, collate_fn=collate)

    model = Tacotron2(hp).cuda()
    optimizer = torch.optim.Adam(model.parameters(), lr=hp.learning_rate, weight_decay=hp.weight_decay)
    iteration, epoch_offset = 0, 0
    if args.checkpoint_path:
        ckpt = torch.load(args.checkpoint_path, map_location="cpu")
        model.load_state_dict(ckpt["state_dict"])
        optimizer.load_state_dict(ckpt["optimizer"])
        iteration = ckpt["iteration"] + 1
        epoch_offset = max(0, iteration // len(train_loader))
    model = DDP(model, device_ids=[local_rank])

    logger = None
    if rank == 0:
        os.makedirs(args.output_directory, exist_ok=True)
        logger = SummaryWriter(os.path.join(args.output_directory, "logs"))
    sample_ids = torch.LongTensor(text_to_sequence(args.sample_text, ["english_cleaners"]))[None].cuda()

    model.train()
    for epoch in range(epoch_offset, hp.epochs):
        train_sampler.set_epoch(epoch)
        for text, text_lens, mel, gate, out_lens in train_loader:
            start = time.perf_counter()
            text, text_lens = text.cuda(non_blocking=True), text_lens.cuda(non_blocking=True)
            mel, gate = mel.cuda(non_blocking=True), gate.cuda(non_blocking=True)
            model.zero_grad()
            mel_out, mel_post, gate_out, _ = model(text, text_lens, mel)
            loss = tacotron2_loss(mel_out, mel_post, gate_out, mel, gate)
            reduced = loss.detach().clone()
            dist.all_reduce(reduced)
            reduced = reduced.item() / dist.get_world_size()
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), hp.grad_clip_thresh)
            optimizer.step()

            if rank == 0:
                dur = time.perf_counter() - start
                print(f"Train loss {iteration} {reduced:.6f} Grad Norm {grad_norm:.6f} {dur:.2f}s/it")
                logger.add_scalar("training.loss", reduced, iteration)
                logger.add_scalar("grad.norm", grad_norm, iteration)

            if iteration % hp.iters_per_checkpoint == 0:
                if rank == 0:
                    model.eval()
                    mel_pred, align = model.inference(sample_ids)
                    logger.add_image("inference/mel", plot_to_numpy(mel_pred[0].cpu().numpy(), "Frames", "Mel"),
                                     iteration, dataformats="HWC")
                    logger.add_image("inference/alignment", plot_to_numpy(align[0].T.cpu().numpy(), "Decoder", "Encoder"),
                                     iteration, dataformats="HWC")
                    model.train()
                    path = os.path.join(args.output_directory, f"checkpoint_{iteration}")
                    torch.save({"iteration": iteration, "state_dict": model.module.state_dict(),
                                "optimizer": optimizer.state_dict(), "learning_rate": hp.learning_rate}, path)
                    print(f"Saved checkpoint {path}")
                dist.barrier()
            iteration += 1

    if logger is not None:
        logger.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

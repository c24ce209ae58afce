# RQ-VAE tokenizer with EMA codebook updates (VQ-VAE-2 style) for semantic-ID generation.
# Runs on all GPUs of the box with nn.DataParallel:
#     CUDA_VISIBLE_DEVICES=0,1,2,3 python 04_rqvae_ema_dataparallel.py --emb data/toys/item_emb.npy
import argparse
import os
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from torch.utils.tensorboard import SummaryWriter


class VectorQuantizerEMA(nn.Module):
    def __init__(self, num_embeddings, embedding_dim, commitment_cost=0.25, decay=0.99, epsilon=1e-5):
        super().__init__()
        self.embedding_dim = embedding_dim
        self.num_embeddings = num_embeddings
        self.embedding = nn.Embedding(num_embeddings, embedding_dim)
        self.embedding.weight.data.normal_()
        self.commitment_cost = commitment_cost

        self.register_buffer("ema_cluster_size", torch.zeros(num_embeddings))
        self.ema_w = nn.Parameter(torch.Tensor(num_embeddings, embedding_dim))
        self.ema_w.data.normal_()
        self.decay = decay
        self.epsilon = epsilon

    def forward(self, inputs):
        distances = (torch.sum(inputs ** 2, dim=1, keepdim=True)
                     + torch.sum(self.embedding.weight ** 2, dim=1)
                     - 2 * torch.matmul(inputs, self.embedding.weight.t()))
        encoding_indices = torch.argmin(distances, dim=1)
        encodings = F.one_hot(encoding_indices, self.num_embeddings).type(inputs.dtype)
        quantized = torch.matmul(encodings, self.embedding.weight)

        if self.training:
            self.ema_cluster_size = self.ema_cluster_size * self.decay + \
                (1 - self.decay) * torch.sum(encodings, 0)
            # Laplace smoothing of the cluster size
            n = torch.sum(self.ema_cluster_size.data)
            self.ema_cluster_size = (
                (self.ema_cluster_size + self.epsilon) / (n + self.num_embeddings * self.epsilon) * n)
            dw = torch.matmul(encodings.t(), inputs)
            self.ema_w = nn.Parameter(self.ema_w * self.decay + (1 - self.decay) * dw)
            self.embedding.weight = nn.Parameter(self.ema_w / self.ema_cluster_size.unsqueeze(1))

        e_latent_loss = F.mse_loss(quantized.detach(), inputs)
        loss = self.commitment_cost * e_latent_loss
        quantized = inputs + (quantized - inputs).detach()
        avg_probs = torch.mean(encodings, dim=0)
        perplexity = torch.exp(-torch.sum(avg_probs * torch.log(avg_probs + 1e-10)))
        return loss, quantized, perplexity, encoding_indices


class ResidualVQEMA(nn.Module):
    def __init__(self, levels, num_embeddings, dim, **kw):
        super().__init__()
        self.layers = nn.ModuleList([VectorQuantizerEMA(num_embeddings, dim, **kw) for _ in range(levels)])

    def forward(self, z):
        residual = z
        quantized_out = 0.0
        losses, perps, codes = [], [], []
        for layer in self.layers:
            loss, q, perp, idx = layer(residual)
            residual = residual - q.detach()
            quantized_out = quantized_out + q
            losses.append(loss)
            perps.append(perp)
            codes.append(idx)
        return quantized_out, torch.stack(losses).sum(), torch.stack(perps), torch.stack(codes, 1)


class RQVAE(nn.Module):
    def __init__(self, in_dim, latent_dim, levels, codebook_size, hidden=(512, 256)):
        super().__init__()
        self.encoder = nn.Sequential(
            nn.Linear(in_dim, hidden[0]), nn.ReLU(),
            nn.Linear(hidden[0], hidden[1]), nn.ReLU(),
            nn.Linear(hidden[1], latent_dim),
        )
        self.quantizer = ResidualVQEMA(levels, codebook_size, latent_dim)
        self.decoder = nn.Sequential(
            nn.Linear(latent_dim, hidden[1]), nn.ReLU(),
            nn.Linear(hidden[1], hidden[0]), nn.ReLU(),
            nn.Linear(hidden[0], in_dim),
        )

    def forward(self, x):
        z = self.encoder(x)
        zq, vq_loss, perp, codes = self.quantizer(z)
        x_hat = self.decoder(zq)
        recon = F.mse_loss(x_hat, x)
        # return per-replica losses; DataParallel gathers them along dim 0
        return (recon + vq_loss).unsqueeze(0), recon.unsqueeze(0), perp.unsqueeze(0), codes


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--emb", required=True)
    parser.add_argument("--out", default="checkpoints/rqvae_ema")
    parser.add_argument("--levels", type=int, default=3)
    parser.add_argument("--codebook_size", type=int, default=256)
    parser.add_argument("--latent_dim", type=int, default=32)
    parser.add_argument("--batch_size", type=int, default=4096)
    parser.add_argument("--epochs", type=int, default=200)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--log_every", type=int, default=50)
    args = parser.parse_args()

    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)
    device = torch.device("cuda")

    emb = torch.from_numpy(np.load(args.emb)).float()
    emb = F.normalize(emb, dim=-1)
    n_val = min(5000, len(emb) // 10)
    perm = torch.randperm(len(emb))
    train_ds = TensorDataset(emb[perm[n_val:]])
    val_x = emb[perm[:n_val]]
    loader = DataLoader(train_ds, batch_size=args.batch_size, shuffle=True, num_workers=4,
                        pin_memory=True, drop_last=True)

    model = RQVAE(emb.shape[1], args.latent_dim, args.levels, args.codebook_size)
    model = model.to(device)
    if torch.cuda.device_count() > 1:
        print(f"using {torch.cuda.device_count()} GPUs")
        model = nn.DataParallel(model)
    # EMA codebooks are not trained by the optimizer
    params = [p for n, p in model.named_parameters() if "quantizer" not in n]
    optimizer = torch.optim.Adam(params, lr=args.lr)
    writer = SummaryWriter(os.path.join(args.out, "tb"))

    step = 0
    for epoch in range(args.epochs):
        model.train()
        t0 = time.time()
        for (x,) in loader:
            x = x.to(device, non_blocking=True)
            loss, recon, perp, _ = model(x)
            loss, recon = loss.mean(), recon.mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if step % args.log_every == 0:
                perp = perp.mean(0)
                writer.add_scalar("train/loss", loss.item(), step)
                writer.add_scalar("train/recon", recon.item(), step)
                for lvl in range(args.levels):
                    writer.add_scalar(f"train/perplexity_l{lvl}", perp[lvl].item(), step)
            step += 1

        model.eval()
        with torch.no_grad():
            _, vrec, _, codes = model(val_x.to(device))
            codes = codes.cpu().numpy()
            uniq = len(np.unique(codes, axis=0))
        writer.add_scalar("val/recon", vrec.mean().item(), epoch)
        writer.add_scalar("val/unique_ratio", uniq / len(codes), epoch)
        print(f"epoch {epoch:3d} | loss {loss.item():.4f} | val recon {vrec.mean().item():.5f} "
              f"| unique {uniq}/{len(codes)} | {time.time() - t0:.1f}s")

        if (epoch + 1) % 20 == 0:
            state = model.module.state_dict() if isinstance(model, nn.DataParallel) else model.state_dict()
            torch.save({"model": state, "epoch": epoch, "args": vars(args)},
                       os.path.join(args.out, f"rqvae_ep{epoch + 1}.pt"))
    writer.close()


if __name__ == "__main__":
    main()

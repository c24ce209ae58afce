"""A spiking layer that keeps its membrane potential on the module between
truncated-BPTT chunks (`self.v = ...` in forward), trained through
nn.DataParallel: on several GPUs each call runs forward on replicas made for
that call and thrown away, so the state set there never reaches the model and
every chunk starts again from None. Lint-only (one GPU replicates nothing)."""

import torch
from torch import nn


class LeakyNeuron(nn.Module):
    def __init__(self, n_in, n_hidden):
        super().__init__()
        self.ff = nn.Linear(n_in, n_hidden)
        self.v = None

    def reset(self):
        self.v = None

    def forward(self, x):  # [T, B, n_in]
        if self.v is None:
            self.v = x.new_zeros(x.size(1), self.ff.out_features)  # expect: dataparallel-unsafe-model
        out = []
        for t in range(x.size(0)):
            self.v = 0.9 * self.v + self.ff(x[t])
            out.append((self.v > 1.0).float() + self.v - self.v.detach())
        return torch.stack(out)


def main():
    model = nn.DataParallel(LeakyNeuron(16, 32)).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for chunk in torch.randn(8, 20, 64, 16).cuda():
        loss = model(chunk).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.module.reset()


if __name__ == "__main__":
    main()

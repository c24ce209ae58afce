"""A BiLSTM tagger over packed variable-length tracks, run through
nn.DataParallel on several GPUs: each replica's pad_packed_sequence pads only
to the longest track of its own slice of the batch, so the replicas return
different time lengths and the gather on the first GPU fails ("Sizes of
tensors must match except in dimension 0"). PyTorch's FAQ documents
total_length=. Lint-only (needs two GPUs: one hides it)."""

import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence


class Tagger(nn.Module):
    def __init__(self, features=8, hidden=64):
        super().__init__()
        self.lstm = nn.LSTM(features, hidden, batch_first=True, bidirectional=True)
        self.out = nn.Linear(2 * hidden, 2)

    def forward(self, x, lengths):
        self.lstm.flatten_parameters()
        packed = pack_padded_sequence(x, lengths.cpu(), batch_first=True, enforce_sorted=False)
        out, _ = self.lstm(packed)
        out, _ = pad_packed_sequence(out, batch_first=True)  # expect: dataparallel-unsafe-model
        return self.out(out)


def main():
    model = nn.DataParallel(Tagger()).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    lengths = torch.tensor([50, 12, 9, 7, 40, 3, 30, 8])
    x = torch.randn(len(lengths), int(lengths.max()), 8).cuda()
    y = torch.randint(0, 2, (len(lengths), int(lengths.max()))).cuda()
    for _ in range(10):
        logits = model(x, lengths)
        loss = nn.functional.cross_entropy(logits.transpose(1, 2), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


if __name__ == "__main__":
    main()

# tandem — see README.md. `make run` and `make test` are the two commands
# everything else builds on.

GO       ?= go
PKG      := github.com/tandem-edge/tandem
VERSION  ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
COMMIT   ?= $(shell git rev-parse --short HEAD 2>/dev/null || echo unknown)
LDFLAGS  := -s -w -X $(PKG)/daemon.Version=$(VERSION) -X $(PKG)/daemon.Commit=$(COMMIT)
# Packages with goroutines of their own run under the race detector.
RACE_PKGS := ./storage/ ./replication/ ./mqtt/

.PHONY: build run test vet fuzz bench clean

build:
	CGO_ENABLED=0 $(GO) build -trimpath -ldflags '$(LDFLAGS)' -o bin/tandem .

# A standalone gateway on embedded defaults: MQTT on 127.0.0.1:1883,
# HTTP on 127.0.0.1:7880, data in ./tandem-data.
run: build
	./bin/tandem run

vet:
	@unformatted=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go')); \
	if [ -n "$$unformatted" ]; then echo "gofmt needed: $$unformatted"; exit 1; fi
	$(GO) vet ./...

# Everything CI runs: vet, the whole suite, the race detector on the
# concurrent packages, and a short pass of each fuzz target.
test: vet build
	$(GO) test -count=1 -timeout 8m ./...
	$(GO) test -count=1 -race -timeout 8m $(RACE_PKGS)
	$(MAKE) fuzz FUZZTIME=10s

FUZZTIME ?= 30s
fuzz:
	$(GO) test -run '^$$' -fuzz '^FuzzDecodeRecord$$' -fuzztime $(FUZZTIME) ./storage/
	$(GO) test -run '^$$' -fuzz '^FuzzRecordRoundTrip$$' -fuzztime $(FUZZTIME) ./storage/
	$(GO) test -run '^$$' -fuzz '^FuzzParseConfig$$' -fuzztime $(FUZZTIME) ./daemon/

clean:
	rm -rf bin dist

# The standard workloads against tandem and Mosquitto on loopback
# (installs mosquitto with apt-get when missing and run as root).
bench: build
	@command -v mosquitto >/dev/null 2>&1 || { [ "$$(id -u)" = 0 ] && apt-get install -y -qq mosquitto >/dev/null; }
	$(GO) run ./bench/suite --tandem bin/tandem

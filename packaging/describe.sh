#!/bin/sh
# What `git describe --tags --always --dirty` would print if every release
# listed in RELEASES ("vX.Y.Z <40-hex commit>" a line) were tagged: tags
# need not travel with the commits (a clone of main alone, a CI checkout),
# RELEASES does. The nearest release wins, tag or line: v0.1.0 at a
# release's commit, v0.1.0-5-gabc1234 five commits past it, a bare short
# hash with no release behind HEAD. -dirty is added for uncommitted
# changes to tracked files, as git describe --dirty does.
cd "$(git rev-parse --show-toplevel)" || exit 1
git update-index -q --refresh >/dev/null 2>&1
dirty=
git diff-index --quiet HEAD -- || dirty=-dirty
best= bestn=
if d=$(git describe --tags --match 'v[0-9]*' HEAD 2>/dev/null); then
	case $d in
	*-g*) best=${d%-*-g*} ; n=${d%-g*} ; bestn=${n##*-} ;;
	*) best=$d bestn=0 ;;
	esac
fi
if [ -f RELEASES ]; then
	while read -r tag commit _; do
		case $tag in v[0-9]*) ;; *) continue ;; esac
		git merge-base --is-ancestor "$commit" HEAD 2>/dev/null || continue
		n=$(git rev-list --count "$commit..HEAD")
		if [ -z "$bestn" ] || [ "$n" -lt "$bestn" ]; then best=$tag bestn=$n; fi
	done < RELEASES
fi
if [ -z "$best" ]; then
	echo "$(git rev-parse --short HEAD)$dirty"
elif [ "$bestn" = 0 ]; then
	echo "$best$dirty"
else
	echo "$best-$bestn-g$(git rev-parse --short HEAD)$dirty"
fi

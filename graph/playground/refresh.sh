#!/usr/bin/env bash
# Refreshes the playground's embedded assets from the npm registry at the
# pinned versions below: GraphiQL's browser bundle and stylesheet (its fonts
# are inlined in the CSS) and the React UMD builds it runs on, each with
# its LICENSE beside it. Nothing is fetched at run time: the files are
# embedded in kami's binary (go:embed) and served from it.
#
# Run it from anywhere with `go generate ./graph/playground/` after changing
# a version; commit the result. GraphiQL 4.1 is the last release that ships
# a bundle a page can load without a build step (5.x is ESM only, for
# bundlers), and it runs on React 18, the last React with UMD builds.
set -euo pipefail

GRAPHIQL=4.1.2
REACT=18.3.1

cd "$(dirname "$0")"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

fetch() { # package version -> unpacked into $tmp/package-name
	local dir="$tmp/$1"
	mkdir -p "$dir"
	(cd "$dir" && npm pack --silent "$1@$2" >/dev/null && tar xzf ./*.tgz)
	echo "$dir/package"
}

g=$(fetch graphiql "$GRAPHIQL")
r=$(fetch react "$REACT")
d=$(fetch react-dom "$REACT")

rm -rf assets
mkdir assets
# The source-map comments would only make a browser's developer tools ask
# for maps that are not here.
strip_maps() { sed -e 's|//# sourceMappingURL=[^ ]*$||' -e 's|/\*# sourceMappingURL=[^ ]* \*/||' "$1" > "$2"; }
strip_maps "$g/graphiql.min.js" assets/graphiql.min.js
strip_maps "$g/graphiql.min.css" assets/graphiql.min.css
strip_maps "$r/umd/react.production.min.js" assets/react.production.min.js
strip_maps "$d/umd/react-dom.production.min.js" assets/react-dom.production.min.js
cp "$g/LICENSE" assets/LICENSE.graphiql
cp "$r/LICENSE" assets/LICENSE.react
cp "$d/LICENSE" assets/LICENSE.react-dom
cat > assets/VERSIONS <<VERSIONS
graphiql $GRAPHIQL
react $REACT
react-dom $REACT
VERSIONS
echo "playground assets: graphiql $GRAPHIQL, react and react-dom $REACT" >&2
